#include "loaders/model_spec.h"

#include <gtest/gtest.h>

#include <cctype>
#include <cmath>
#include <nlohmann/json.hpp>
#include <tuple>

#include "loaders/checkpoint.h"
#include "loaders/writer.h"
#include "tests/loaders/test_util.h"

namespace shardcast {
namespace {

std::string Config(const std::string& name) { return std::string(SHARDCAST_SOURCE_DIR) + "/configs/models/" + name; }

struct Published {
  const char* file;
  double params;  // published totals, configs/models/README.md
};

class ParameterCount : public ::testing::TestWithParam<Published> {};

TEST_P(ParameterCount, WithinOnePercentOfPublished) {
  ModelSpec spec = BuildModelSpec(Config(GetParam().file));
  double got = static_cast<double>(spec.parameter_count());
  EXPECT_LT(std::fabs(got - GetParam().params) / GetParam().params, 0.01)
      << GetParam().file << ": " << got / 1e9 << " B parameters";
}

INSTANTIATE_TEST_SUITE_P(Models, ParameterCount,
                         ::testing::Values(Published{"llama-3.1-8b.json", 8.0e9}, Published{"mixtral-8x7b.json", 46.7e9},
                                           Published{"qwen3-30b-a3b.json", 30.5e9}, Published{"minimax-m2.json", 229e9},
                                           Published{"deepseek-v3.json", 671e9}),
                         [](const ::testing::TestParamInfo<Published>& info) {
                           std::string name = info.param.file;
                           name = name.substr(0, name.find(".json"));
                           for (char& c : name) c = std::isalnum(static_cast<unsigned char>(c)) ? c : '_';
                           return name;
                         });

TEST(ModelSpec, DeepseekHasFp8SidecarsRoutingBiasAndMlaRope) {
  ModelSpec spec = BuildModelSpec(Config("deepseek-v3.json"));
  EXPECT_EQ(spec.num_layers, 61);
  const SpecEntry* w = spec.Find("model.layers.3.mlp.experts.7.down_proj.weight");
  ASSERT_NE(w, nullptr);
  EXPECT_EQ(w->dtype, DType::kF8_E4M3);
  EXPECT_EQ(w->shape, (std::vector<uint64_t>{7168, 2048}));
  const SpecEntry* s = spec.Find("model.layers.3.mlp.experts.7.down_proj.weight_scale_inv");
  ASSERT_NE(s, nullptr);
  EXPECT_EQ(s->role, Role::kSidecar);
  EXPECT_EQ(s->dtype, DType::kF32);
  EXPECT_EQ(s->shape, (std::vector<uint64_t>{56, 16}));
  const SpecEntry* kvb = spec.Find("model.layers.0.self_attn.kv_a_proj_with_mqa.weight_scale_inv");
  ASSERT_NE(kvb, nullptr);
  EXPECT_EQ(kvb->shape, (std::vector<uint64_t>{5, 56}));  // ceil(576/128), ceil(7168/128)
  const SpecEntry* bias = spec.Find("model.layers.3.mlp.gate.e_score_correction_bias");
  ASSERT_NE(bias, nullptr);
  EXPECT_EQ(bias->role, Role::kPersistentBuffer);
  EXPECT_EQ(spec.Find("model.layers.2.mlp.gate.e_score_correction_bias"), nullptr);  // dense layer
  EXPECT_EQ(spec.Find("model.layers.3.mlp.gate.weight")->dtype, DType::kBF16);      // router not quantized
  EXPECT_EQ(spec.Find("model.embed_tokens.weight")->dtype, DType::kBF16);
  EXPECT_EQ(spec.Find("model.layers.61.self_attn.o_proj.weight"), nullptr);  // the MTP layer is not the model's
  const SpecEntry* rope = spec.Find("model.rotary_emb.inv_freq");
  ASSERT_NE(rope, nullptr);
  EXPECT_EQ(rope->role, Role::kNonPersistentBuffer);
  EXPECT_EQ(rope->shape, std::vector<uint64_t>{32});
  EXPECT_EQ(rope->init_rule, "rotary_inv_freq");
}

TEST(ModelSpec, RotaryDimsFollowEachArchitecture) {
  EXPECT_EQ(BuildModelSpec(Config("llama-3.1-8b.json")).Find("model.rotary_emb.inv_freq")->shape[0], 64u);
  ModelSpec mm = BuildModelSpec(Config("minimax-m2.json"));
  EXPECT_EQ(mm.Find("model.rotary_emb.inv_freq")->shape[0], 32u);  // rotary_dim 64 of head_dim 128
  EXPECT_EQ(mm.Find("model.layers.0.self_attn.q_norm.weight")->shape[0], 6144u);
  EXPECT_EQ(mm.Find("model.layers.0.block_sparse_moe.e_score_correction_bias")->role, Role::kPersistentBuffer);
  EXPECT_EQ(mm.Find("model.layers.0.block_sparse_moe.experts.255.w2.weight")->shape,
            (std::vector<uint64_t>{3072, 1536}));
}

TEST(ModelSpec, LayersKeepsTheFirstN) {
  ModelSpec full = BuildModelSpec(Config("qwen3-30b-a3b.json"));
  ModelSpec two = BuildModelSpec(Config("qwen3-30b-a3b.json"), SpecOptions{2});
  EXPECT_EQ(two.num_layers, 2);
  EXPECT_EQ(two.total_layers, 48);
  EXPECT_NE(two.Find("model.layers.1.mlp.experts.127.up_proj.weight"), nullptr);
  EXPECT_EQ(two.Find("model.layers.2.mlp.gate.weight"), nullptr);
  EXPECT_NE(two.Find("lm_head.weight"), nullptr);
  EXPECT_LT(two.parameter_count(), full.parameter_count() / 10);
}

TEST(ModelSpec, BadConfigsNameTheField) {
  EXPECT_SC_ERROR(BuildModelSpecFromJson("c.json", R"({"model_type":"gpt9","num_hidden_layers":1})"),
                  ErrorKind::kConfig, "c.json", "unknown model_type \"gpt9\"", "llama");
  EXPECT_SC_ERROR(BuildModelSpecFromJson("c.json", R"({"num_hidden_layers":1})"), ErrorKind::kConfig,
                  "missing field \"model_type\"");
  EXPECT_SC_ERROR(BuildModelSpecFromJson("c.json", R"({"model_type":"llama","num_hidden_layers":1,"hidden_size":8})"),
                  ErrorKind::kConfig, "missing field \"num_attention_heads\"");
  EXPECT_SC_ERROR(BuildModelSpecFromJson("c.json", R"({"model_type":"llama","num_hidden_layers":-1})"),
                  ErrorKind::kConfig, "\"num_hidden_layers\" must be a non-negative integer");
  EXPECT_SC_ERROR(BuildModelSpecFromJson("c.json", "[1]"), ErrorKind::kConfig, "not a JSON object");
  EXPECT_SC_ERROR(BuildModelSpec("/nonexistent/config.json"), ErrorKind::kConfig, "cannot open");
}

// transformers 5's save_pretrained writes the expert count under the name its config class keeps
// (qwen3_moe: num_local_experts) where the published config says num_experts, and the other way for
// Mixtral-style configs: either name builds the same model, and two names that differ are an error.
TEST(ModelSpec, ExpertCountUnderEitherName) {
  for (const auto& [file, published, other] : {std::tuple{"qwen3-30b-a3b.json", "num_experts", "num_local_experts"},
                                               std::tuple{"mixtral-8x7b.json", "num_local_experts", "num_experts"}}) {
    SCOPED_TRACE(file);
    nlohmann::json j = nlohmann::json::parse(testing::ReadFile(Config(file)));
    j["num_hidden_layers"] = 2;
    const ModelSpec want = BuildModelSpecFromJson("c.json", j.dump());
    j[other] = j[published];
    j.erase(published);
    const ModelSpec got = BuildModelSpecFromJson("c.json", j.dump());
    ASSERT_EQ(got.entries.size(), want.entries.size());
    for (size_t i = 0; i < got.entries.size(); ++i) {
      EXPECT_EQ(got.entries[i].key, want.entries[i].key);
      EXPECT_EQ(got.entries[i].shape, want.entries[i].shape);
    }
    j[published] = j[other].get<int>() + 1;
    EXPECT_SC_ERROR(BuildModelSpecFromJson("c.json", j.dump()), ErrorKind::kConfig, "c.json",
                    "name the same thing and differ", other);
  }
}

TEST(ModelSpec, TiedEmbeddingsHaveNoLmHead) {
  ModelSpec s = BuildModelSpecFromJson("c.json", R"({"model_type":"llama","num_hidden_layers":1,"hidden_size":8,
      "num_attention_heads":2,"intermediate_size":16,"vocab_size":10,"tie_word_embeddings":true})");
  EXPECT_TRUE(s.tie_word_embeddings);
  EXPECT_EQ(s.Find("lm_head.weight"), nullptr);
}

}  // namespace
// An architecture with no builder: the checkpoint's own tensors, each in the layer its key names, whatever
// the model calls its stack; --layers keeps what is in no layer and the layers below N.
TEST(ModelSpec, FromCheckpointTakesEveryTensorAsStoredWithItsLayer) {
  testing::TempDir dir;
  const std::vector<std::pair<std::string, int>> keys = {
      {"model.embed_tokens.weight", -1}, {"model.layers.0.mlp.up_proj.weight", 0},
      {"model.layers.11.self_attn.q_proj.weight", 11}, {"transformer.h.3.attn.c_attn.weight", 3},
      {"encoder.block.2.layer.0.SelfAttention.q.weight", 2}, {"layers.5.w", 5}, {"model.norm.weight", -1},
      {"model.layers.7", -1}, {"model.mylayers.4.w", -1}, {"model.layers.x.w", -1}};
  std::vector<WriteEntry> entries;
  for (const auto& [k, _] : keys) entries.push_back({k, DType::kBF16, {2, 3}});
  SafetensorsWriter w(dir / "model.safetensors", entries);
  for (size_t i = 0; i < keys.size(); ++i) w.Append(std::string(12, 'x').data(), 12);
  w.Commit();
  const auto ckpt = Checkpoint::Open(dir.path());
  const ModelSpec spec = SpecFromCheckpoint(*ckpt, "cfg", "gemma9");
  EXPECT_EQ(spec.model_type, "gemma9");
  EXPECT_EQ(spec.total_layers, 12);
  ASSERT_EQ(spec.entries.size(), keys.size());
  for (const auto& [k, layer] : keys) {
    const SpecEntry* e = spec.Find(k);
    ASSERT_NE(e, nullptr) << k;
    EXPECT_EQ(e->layer, layer) << k;
    EXPECT_EQ(e->role, Role::kParameter) << k;
    EXPECT_EQ(e->dtype, DType::kBF16) << k;
    EXPECT_EQ(e->shape, (std::vector<uint64_t>{2, 3})) << k;
  }
  const ModelSpec first3 = SpecFromCheckpoint(*ckpt, "cfg", "gemma9", SpecOptions{3});
  EXPECT_EQ(first3.num_layers, 3);
  for (const auto& [k, layer] : keys) EXPECT_EQ(first3.Find(k) != nullptr, layer < 3) << k;
  EXPECT_FALSE(HasBuilderFor(R"({"model_type": "gemma9"})"));
  EXPECT_TRUE(HasBuilderFor(R"({"model_type": "llama"})"));
  EXPECT_FALSE(HasBuilderFor("not json"));
}

}  // namespace shardcast
