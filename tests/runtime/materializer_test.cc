#include "runtime/materialize/materializer.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "allocators/memory_probe.h"
#include "runtime/materialize/rope.h"
#include "tests/loaders/test_util.h"

namespace shardcast {
namespace {

constexpr const char* kTinyDeepseek = R"({"model_type":"deepseek_v3","num_hidden_layers":2,
    "hidden_size":24,"intermediate_size":40,"moe_intermediate_size":8,"num_attention_heads":3,"q_lora_rank":12,
    "kv_lora_rank":8,"qk_nope_head_dim":4,"qk_rope_head_dim":8,"v_head_dim":4,"n_routed_experts":5,
    "n_shared_experts":1,"first_k_dense_replace":1,"vocab_size":7,"max_position_embeddings":1024,
    "rope_scaling":{"type":"yarn","factor":4,"original_max_position_embeddings":256,"mscale":1,"mscale_all_dim":1}})";

TEST(Materializer, ParametersStayMetaBuffersAreRealAndNothingIsGarbage) {
  ModelSpec spec = BuildModelSpecFromJson("ds.json", kTinyDeepseek);
  Plan plan = Plan::Build(spec, 4);
  RankState s = RankState::Prepare(plan, 3);
  const PrepareReport& r = s.report();
  EXPECT_EQ(r.computed_buffers, 1u);
  EXPECT_EQ(r.persistent_buffers, 1u);
  EXPECT_GT(r.entries_without_rows, 0u);  // 7 vocab rows over 4 ranks leaves rank 3 one; 5 experts' gate: none
  for (const LocalTensor& t : s.tensors()) {
    switch (t.entry->role) {
      case Role::kParameter:
      case Role::kSidecar:
        EXPECT_TRUE(t.is_meta()) << t.entry->key;
        EXPECT_TRUE(t.MetaTensor().is_meta());
        EXPECT_EQ(t.MetaTensor().size(0), static_cast<int64_t>(t.local_shape[0])) << t.entry->key;
        break;
      case Role::kPersistentBuffer:
        EXPECT_FALSE(t.tensor.is_meta());
        EXPECT_EQ(t.tensor.count_nonzero().item<int64_t>(), 0) << t.entry->key << " must be explicitly zero";
        break;
      case Role::kNonPersistentBuffer: {
        RopeInit want = ComputeRope(nlohmann::json::parse(kTinyDeepseek), "ds.json", 8);
        ASSERT_EQ(t.tensor.numel(), 4);
        for (int i = 0; i < 4; ++i) EXPECT_EQ(t.tensor.data_ptr<float>()[i], want.inv_freq[i]);
        EXPECT_NE(t.note.find("yarn"), std::string::npos);
        break;
      }
    }
  }
  s.AllocateShards();
  for (const LocalTensor& t : s.tensors()) {
    ASSERT_FALSE(t.is_meta()) << t.entry->key;
    if (t.from_checkpoint) {
      EXPECT_EQ(t.tensor.count_nonzero().item<int64_t>(), 0) << t.entry->key;
    }
  }
  EXPECT_EQ(s.Find("model.embed_tokens.weight")->tensor.sizes(), (at::IntArrayRef{1, 24}));
  EXPECT_EQ(s.Find("model.layers.1.mlp.gate.weight")->tensor.sizes(), (at::IntArrayRef{0, 24}));  // 5 rows: 2,2,1,0
}

TEST(Materializer, BadInputNamesTheEntry) {
  ModelSpec spec = BuildModelSpecFromJson("ds.json", kTinyDeepseek);
  Plan plan = Plan::Build(spec, 2);
  EXPECT_SC_ERROR(RankState::Prepare(plan, 2), ErrorKind::kInvalidArgument, "rank 2 is outside world size 2");
  EXPECT_SC_ERROR(RankState::Prepare(plan, -1), ErrorKind::kInvalidArgument, "rank -1");
  nlohmann::json bad = nlohmann::json::parse(kTinyDeepseek);
  bad["rope_scaling"]["type"] = "su";
  ModelSpec bad_spec = BuildModelSpecFromJson("bad.json", bad.dump());
  Plan bad_plan = Plan::Build(bad_spec, 2);
  EXPECT_SC_ERROR(RankState::Prepare(bad_plan, 0), ErrorKind::kConfig, "model.rotary_emb.inv_freq",
                  "rope type \"su\" has no init rule");
  ModelSpec no_rule = spec;
  for (auto& e : no_rule.entries) {
    if (e.role == Role::kNonPersistentBuffer) {
      e.key = "model.layers.0.self_attn.alibi_slopes";
      e.init_rule = {};
    }
  }
  Plan no_rule_plan = Plan::Build(no_rule, 2);
  EXPECT_SC_ERROR(RankState::Prepare(no_rule_plan, 0), ErrorKind::kConfig,
                  "model.layers.0.self_attn.alibi_slopes", "has no init rule");
}

TEST(Materializer, FullScaleDeepseekRankHoldsAlmostNothing) {
  ModelSpec spec = BuildModelSpec(std::string(SHARDCAST_SOURCE_DIR) + "/configs/models/deepseek-v3.json");
  Plan plan = Plan::Build(spec, 8);
  uint64_t before = ReadMemory().rss_anon;
  RankState s = RankState::Prepare(plan, 3);
  EXPECT_EQ(s.report().shard_bytes, plan.LocalBytes(3).by_role[0] + plan.LocalBytes(3).by_role[3]);
  EXPECT_LT(s.report().buffer_bytes, 1u << 20);
  EXPECT_LT(ReadMemory().rss_anon, before + (256u << 20)) << "meta parameters must not commit memory";
}

TEST(Materializer, PinnedAndCudaTargetsFailClearlyWithoutADevice) {
  ModelSpec spec = BuildModelSpecFromJson("ds.json", kTinyDeepseek);
  Plan plan = Plan::Build(spec, 1);
  for (Target t : {Target::kPinned, Target::kCuda}) {
    try {
      PrepareOptions options;
      options.target = t;
      RankState::Prepare(plan, 0, options);  // works on a GPU machine
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::kUnsupported) << e.what();
    }
  }
  EXPECT_EQ(ParseTarget("cuda"), Target::kCuda);
  EXPECT_FALSE(ParseTarget("tpu").has_value());
}

}  // namespace
}  // namespace shardcast
