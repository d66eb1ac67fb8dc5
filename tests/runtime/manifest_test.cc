#include "runtime/manifest/manifest.h"

#include <gtest/gtest.h>

#include <cstdlib>

#include "loaders/quant/format.h"
#include "loaders/synth.h"
#include "tests/loaders/test_util.h"
#include "tests/runtime/layout_cases.h"

namespace shardcast {
namespace {

StreamParams Strict() {
  StreamParams p;
  p.strict_keys = true;
  return p;
}

void ExpectSame(const Manifest& a, const Manifest& b) {
  EXPECT_EQ(a.world_size, b.world_size);
  ASSERT_EQ(a.files.size(), b.files.size());
  for (size_t i = 0; i < a.files.size(); ++i) {
    EXPECT_EQ(a.files[i].name, b.files[i].name);
    EXPECT_EQ(a.files[i].size, b.files[i].size);
    EXPECT_EQ(a.files[i].digest, b.files[i].digest);
  }
  ASSERT_EQ(a.layouts.size(), b.layouts.size());
  for (size_t i = 0; i < a.layouts.size(); ++i) EXPECT_TRUE(a.layouts[i] == b.layouts[i]) << a.layouts[i].Text();
  ASSERT_EQ(a.entries.size(), b.entries.size());
  for (size_t i = 0; i < a.entries.size(); ++i) {
    const ManifestEntry &x = a.entries[i], &y = b.entries[i];
    EXPECT_EQ(x.key, y.key);
    EXPECT_EQ(x.target_dtype, y.target_dtype);
    EXPECT_EQ(x.shape, y.shape);
    EXPECT_EQ(x.role, y.role);
    EXPECT_EQ(x.layout, y.layout);
    ASSERT_EQ(x.parts.size(), y.parts.size());
    for (size_t j = 0; j < x.parts.size(); ++j) {
      EXPECT_EQ(x.parts[j].checkpoint_key, y.parts[j].checkpoint_key);
      EXPECT_EQ(x.parts[j].source_dtype, y.parts[j].source_dtype);
      EXPECT_EQ(x.parts[j].file, y.parts[j].file);
      EXPECT_EQ(x.parts[j].offset, y.parts[j].offset);
      EXPECT_EQ(x.parts[j].numel, y.parts[j].numel);
      EXPECT_EQ(x.parts[j].shape, y.parts[j].shape);
    }
  }
  EXPECT_EQ(a.skipped, b.skipped);
  EXPECT_EQ(a.skipped_examples, b.skipped_examples);
}

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
  EXPECT_SC_ERROR(Resolve(plan, *ckpt, none, StreamParams{}), ErrorKind::kManifestMismatch,
                  "has no tensor 'model.embed_tokens.weight'");
  KeyMapping m;
  m.add_prefix = "language_model.";
  EXPECT_SC_ERROR(Resolve(plan, *ckpt, m, StreamParams{}), ErrorKind::kManifestMismatch, "key 'lm_head.weight'");
  m.tied["lm_head.weight"] = "model.embed_tokens.weight";
  Manifest man = Resolve(plan, *ckpt, m, Strict());
  for (const auto& e : man.entries) {
    ASSERT_EQ(e.parts.size(), 1u);
    EXPECT_EQ(e.parts[0].checkpoint_key,
              "language_model." + std::string(e.key == "lm_head.weight" ? "model.embed_tokens.weight" : e.key));
  }
  Manifest back = DecodeManifest(EncodeManifest(man));  // the wire format keeps every field
  ExpectSame(back, man);
  EXPECT_EQ(CheckManifest(back, plan, 1, 2), "");
}

TEST_F(ManifestMapping, WireFormatKeepsEveryFieldAndRejectsOtherVersionsAndCutBlobs) {
  Plan plan = Plan::Build(spec_, 3);
  auto ckpt = Checkpoint::Open(dir_.path());
  KeyMapping m;
  m.add_prefix = "language_model.";
  m.tied["lm_head.weight"] = "model.embed_tokens.weight";
  StreamParams p;
  p.source = Source::kEachRank;
  p.chunk_bytes = 12345;
  p.coalesce_bytes = 999;
  p.staging_slots = 7;
  p.verify = true;
  Manifest man = Resolve(plan, *ckpt, m, p);
  ASSERT_EQ(man.files.size(), 1u);
  EXPECT_EQ(man.files[0].name, "model.safetensors");
  EXPECT_EQ(man.files[0].digest, FileDigest(ckpt->file(0)));
  const std::string blob = EncodeManifest(man);
  Manifest back = DecodeManifest(blob);
  ExpectSame(back, man);
  EXPECT_EQ(back.params.source, Source::kEachRank);
  EXPECT_EQ(back.params.chunk_bytes, 12345u);
  EXPECT_EQ(back.params.coalesce_bytes, 999u);
  EXPECT_EQ(back.params.staging_slots, 7u);
  EXPECT_TRUE(back.params.verify);
  EXPECT_FALSE(back.params.strict_keys);
  for (size_t cut : {size_t{0}, size_t{5}, blob.size() / 2, blob.size() - 1}) {
    EXPECT_SC_ERROR(DecodeManifest(blob.substr(0, cut)), ErrorKind::kComm, "malformed");
  }
  EXPECT_SC_ERROR(DecodeManifest(blob + "x"), ErrorKind::kComm, "trailing bytes");
  std::string other = blob;
  other[8 + std::string("shardcast-manifest-").size()] = '9';
  EXPECT_SC_ERROR(DecodeManifest(other), ErrorKind::kComm, "shardcast-manifest-9", "same shardcast");
}

TEST(ManifestParams, VerifyAndStrictKeysMustMatchOtherOptionsAreAdopted) {
  StreamParams reader;
  LoadOptions mine;
  mine.chunk_bytes = 1 << 20;  // differs, but only shapes messages: adopted
  EXPECT_EQ(CheckParams(reader, mine, 2), "");
  mine.verify = true;
  EXPECT_NE(CheckParams(reader, mine, 2).find("verify is off on rank 0 but on on rank 2"), std::string::npos);
  mine.verify = false;
  reader.strict_keys = true;
  EXPECT_NE(CheckParams(reader, mine, 1).find("strict_keys is on on rank 0 but off on rank 1"), std::string::npos);
}

TEST_F(ManifestMapping, StripPrefixAndComposedEntries) {
  ModelSpec prefixed = spec_;
  for (auto& e : prefixed.entries) e.key = "language_model." + e.key;
  // Compose: the model's embedding is the checkpoint's embedding; lm_head from the same tensor.
  Plan plan = Plan::Build(prefixed, 1);
  auto ckpt = Checkpoint::Open(dir_.path());
  KeyMapping m;
  m.compose["language_model.lm_head.weight"] = {"language_model.model.embed_tokens.weight"};
  Manifest man = Resolve(plan, *ckpt, m, StreamParams{});
  EXPECT_EQ(man.entries.back().parts[0].checkpoint_key, "language_model.model.embed_tokens.weight");
  KeyMapping strip;
  strip.strip_prefix = "language_model.";
  EXPECT_SC_ERROR(Resolve(plan, *ckpt, strip, StreamParams{}), ErrorKind::kManifestMismatch,
                  "has no tensor 'model.embed_tokens.weight'");  // stripped: the checkpoint keeps the prefix
  m.compose["language_model.lm_head.weight"] = {"language_model.model.norm.weight"};
  EXPECT_SC_ERROR(Resolve(plan, *ckpt, m, StreamParams{}), ErrorKind::kManifestMismatch,
                  "parts hold 8 elements", "[5, 8] = 40; each part is [8]");
  // Regression (outside trial): of 128 fused experts, one saved [8, 3] where the others are [8, 4] was only
  // "its 128 checkpoint parts hold 4088 elements": the user searched 128 tensors by hand. The odd one is named.
  m.compose["language_model.lm_head.weight"] = {"language_model.model.embed_tokens.weight",
                                                 "language_model.model.norm.weight",
                                                 "language_model.model.embed_tokens.weight"};
  EXPECT_SC_ERROR(Resolve(plan, *ckpt, m, StreamParams{}), ErrorKind::kManifestMismatch, "parts hold 88 elements",
                  "'language_model.model.norm.weight' is [8] in the checkpoint (", "where 2 of the 3 parts are [5, 8]");
}

// The wire blobs of manifests over the test layouts (1-3 d meshes, strided shards, replicas) and one
// part with block scales: each decodes to a manifest that encodes to the same bytes. With
// SHARDCAST_CORPUS_DIR set they are also written there, as the manifest fuzzer's seeds (tools/test.sh).
TEST_F(ManifestMapping, WireBlobsOfEveryLayoutEncodeBackToThemselves) {
  KeyMapping m;
  m.add_prefix = "language_model.";
  m.tied["lm_head.weight"] = "model.embed_tokens.weight";
  auto ckpt = Checkpoint::Open(dir_.path());
  const char* dump = std::getenv("SHARDCAST_CORPUS_DIR");
  struct Case {
    const char* name;
    const char* layout;  // "" for FSDP's Shard(0) on a 1-d mesh
    int world;
  };
  for (const Case& c : {Case{"fsdp_w3", "", 3}, Case{"tp_fsdp_w4", "tp-fsdp", 4},
                        Case{"hsdp_tp_fsdp_w8", "hsdp-tp-fsdp", 8}, Case{"shard1_w3", "shard1", 3},
                        Case{"fp8_scale_w2", "", 2}}) {
    SCOPED_TRACE(c.name);
    PlanOptions o;
    if (*c.layout != '\0') ApplyTestLayout(c.layout, c.world, spec_, &o);
    Manifest man = Resolve(Plan::Build(spec_, c.world, o), *ckpt, m, Strict());
    if (std::string(c.name) == "fp8_scale_w2") {  // the scale fields, as an fp8 checkpoint's part has them
      ManifestPart& part = man.entries.front().parts.front();
      part.dequantize = true;
      part.scale = man.KeepScale(
          ManifestScale{std::string(part.checkpoint_key) + "_scale_inv", DType::kF32, 0, 64, 1, 1, BlockSize{128, 128}, 0});
    }
    const std::string blob = EncodeManifest(man);
    EXPECT_EQ(EncodeManifest(DecodeManifest(blob)), blob);
    if (dump != nullptr) testing::WriteFile(std::string(dump) + "/" + c.name, blob);
  }
}

}  // namespace
}  // namespace shardcast

namespace shardcast {
namespace {

// Regression (review): a kept-quantized (U8) MXFP4 entry whose blocks lack their scales was reported as
// a shape mismatch (ManifestMismatch, "kept quantized is ..."); the missing scales are the checkpoint's
// fault and come first, as before the format registry. Blocks of fewer than 3 dims name their own shape.
TEST(ManifestMxfp4, KeptQuantizedBlocksWithoutScalesNameTheScalesFirst) {
  testing::TempDir dir;
  WriteCheckpoint(dir.path(), {{"e.down_proj_blocks", DType::kU8, {2, 4, 1, 16}}, {"f.up_proj_blocks", DType::kU8, {4, 16}},
                               {"f.up_proj_scales", DType::kF8_E8M0, {4}}},
                  [](const WriteEntry& e, uint64_t off, unsigned char* out, size_t n) {
                    SynthElements(0, e.key, e.dtype, off, n, out);
                  });
  auto ckpt = Checkpoint::Open(dir.path());
  auto plan_of = [](const std::string& key, std::vector<uint64_t> shape) {
    ModelSpec spec;
    SpecEntry s;
    s.key = key;
    s.shape = std::move(shape);
    s.dtype = DType::kU8;
    spec.entries.push_back(std::move(s));
    return Plan::Build(std::move(spec), 2);
  };
  EXPECT_SC_ERROR(Resolve(plan_of("e.down_proj", {2, 4, 8}), *ckpt, KeyMapping{}, StreamParams{}),
                  ErrorKind::kCheckpoint, "e.down_proj_scales");
  EXPECT_SC_ERROR(Resolve(plan_of("f.up_proj", {4, 8}), *ckpt, KeyMapping{}, StreamParams{}),
                  ErrorKind::kManifestMismatch, "kept quantized is [4, 16]");
}

}  // namespace
}  // namespace shardcast

namespace shardcast {
namespace {

// The manifest's Packing and the registry's packing ids are written in two places (runtime/manifest/manifest.h and
// each entry file of loaders/quant/, which cannot see the runtime): this is what ties them together, both
// ways, so a new format or a renumbering cannot pass one side alone.
TEST(ManifestPacking, EveryPackingIsItsRegistryEntrysId) {
  EXPECT_EQ(QuantFormatOfPacking(static_cast<uint8_t>(Packing::kNone)), &kFp8Format);
  EXPECT_EQ(QuantFormatOfPacking(static_cast<uint8_t>(Packing::kMxfp4)), &kMxfp4Format);
  EXPECT_EQ(QuantFormatOfPacking(static_cast<uint8_t>(Packing::kNvfp4)), &kNvfp4Format);
  for (const QuantFormat* f : QuantFormats()) {
    EXPECT_LE(f->packing, static_cast<uint8_t>(Packing::kNvfp4)) << f->name << " has a packing the manifest cannot carry";
  }
}

}  // namespace
}  // namespace shardcast
