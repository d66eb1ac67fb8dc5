#include "runtime/manifest.h"

#include <gtest/gtest.h>

#include "loaders/synth.h"
#include "tests/loaders/test_util.h"

namespace shardcast {
namespace {

// A checkpoint whose keys carry a prefix the model lacks, with lm_head tied to the embedding.
class ManifestMapping : public ::testing::Test {
 protected:
  void SetUp() override {
    spec_ = BuildModelSpecFromJson("c.json", R"({"model_type":"llama","num_hidden_layers":1,"hidden_size":8,
        "num_attention_heads":2,"intermediate_size":12,"vocab_size":5})");
    std::vector<WriteEntry> entries;
    for (const auto& e : spec_.entries) {
      if (e.role == Role::kNonPersistentBuffer || e.key == "lm_head.weight") continue;
      entries.push_back({"language_model." + e.key, e.dtype, e.shape});
    }
    WriteCheckpoint(dir_.path(), entries, [](const WriteEntry& e, uint64_t off, unsigned char* out, size_t n) {
      SynthElements(0, e.key, e.dtype, off / 2, n / 2, out);
    });
  }
  testing::TempDir dir_;
  ModelSpec spec_;
};

TEST_F(ManifestMapping, AddPrefixAndTiedWeightsResolveByKey) {
  Plan plan = Plan::Build(spec_, 2);
  auto ckpt = Checkpoint::Open(dir_.path());
  KeyMapping none;
  EXPECT_SC_ERROR(Resolve(plan, *ckpt, none, ExtraKeys::kSkip), ErrorKind::kManifestMismatch,
                  "has no tensor 'model.embed_tokens.weight'");
  KeyMapping m;
  m.add_prefix = "language_model.";
  EXPECT_SC_ERROR(Resolve(plan, *ckpt, m, ExtraKeys::kSkip), ErrorKind::kManifestMismatch, "key 'lm_head.weight'");
  m.tied["lm_head.weight"] = "model.embed_tokens.weight";
  Manifest man = Resolve(plan, *ckpt, m, ExtraKeys::kError);
  for (const auto& e : man.entries) {
    ASSERT_EQ(e.parts.size(), 1u);
    EXPECT_EQ(e.parts[0].checkpoint_key,
              "language_model." + (e.key == "lm_head.weight" ? std::string("model.embed_tokens.weight") : e.key));
  }
  Manifest back = Manifest::Deserialize(man.Serialize());  // the wire format keeps every field
  ASSERT_EQ(back.entries.size(), man.entries.size());
  EXPECT_EQ(back.entries.back().parts[0].checkpoint_key, man.entries.back().parts[0].checkpoint_key);
  EXPECT_EQ(back.entries.back().parts[0].offset, man.entries.back().parts[0].offset);
  EXPECT_EQ(CheckManifest(back, plan, 1, 2), "");
}

TEST_F(ManifestMapping, StripPrefixAndComposedEntries) {
  ModelSpec prefixed = spec_;
  for (auto& e : prefixed.entries) e.key = "language_model." + e.key;
  // Compose: the model's embedding is the checkpoint's embedding; lm_head from the same tensor.
  Plan plan = Plan::Build(prefixed, 1);
  auto ckpt = Checkpoint::Open(dir_.path());
  KeyMapping m;
  m.compose["language_model.lm_head.weight"] = {"language_model.model.embed_tokens.weight"};
  Manifest man = Resolve(plan, *ckpt, m, ExtraKeys::kSkip);
  EXPECT_EQ(man.entries.back().parts[0].checkpoint_key, "language_model.model.embed_tokens.weight");
  KeyMapping strip;
  strip.strip_prefix = "language_model.";
  EXPECT_SC_ERROR(Resolve(plan, *ckpt, strip, ExtraKeys::kSkip), ErrorKind::kManifestMismatch,
                  "has no tensor 'model.embed_tokens.weight'");  // stripped: the checkpoint keeps the prefix
  m.compose["language_model.lm_head.weight"] = {"language_model.model.norm.weight"};
  EXPECT_SC_ERROR(Resolve(plan, *ckpt, m, ExtraKeys::kSkip), ErrorKind::kManifestMismatch,
                  "parts hold 8 elements", "[5, 8] = 40");
}

}  // namespace
}  // namespace shardcast
