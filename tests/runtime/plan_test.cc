#include "runtime/layout/plan.h"

#include <gtest/gtest.h>

#include <vector>

#include "tests/loaders/test_util.h"

namespace shardcast {
namespace {

// torch.chunk(arange(n), W) sizes, padded with empty chunks to W ranks, written independently of
// ShardRows: chunk = ceil(n / W); full chunks while rows remain, then the remainder, then zeros.
std::vector<uint64_t> TorchChunkSizes(uint64_t n, int w) {
  std::vector<uint64_t> sizes;
  if (n > 0) {
    uint64_t chunk = n / w + (n % w != 0);
    for (uint64_t left = n; left > 0; left -= std::min(left, chunk)) sizes.push_back(std::min(left, chunk));
  }
  sizes.resize(w, 0);
  return sizes;
}

TEST(ShardRows, MatchesTorchChunkForWorldSizes1To8) {
  for (int w = 1; w <= 8; ++w) {
    for (uint64_t n : {0ull, 1ull, 2ull, 3ull, 4ull, 5ull, 7ull, 8ull, 9ull, 15ull, 16ull, 17ull, 100ull, 129280ull}) {
      std::vector<uint64_t> want = TorchChunkSizes(n, w);
      uint64_t next = 0;
      for (int r = 0; r < w; ++r) {
        RowRange got = ShardRows(n, w, r);
        EXPECT_EQ(got.rows(), want[r]) << "n=" << n << " W=" << w << " rank " << r;
        if (!got.empty()) {
          EXPECT_EQ(got.begin, next) << "n=" << n << " W=" << w << " rank " << r;  // contiguous, in rank order
          next = got.end;
        }
      }
      EXPECT_EQ(next, n) << "rows must be covered exactly once";
    }
  }
}

TEST(ShardRows, TheExamplesFromTheDesign) {
  std::vector<uint64_t> got;
  for (int r = 0; r < 4; ++r) got.push_back(ShardRows(5, 4, r).rows());
  EXPECT_EQ(got, (std::vector<uint64_t>{2, 2, 1, 0}));
  int empty = 0;
  for (int r = 0; r < 8; ++r) empty += ShardRows(3, 8, r).empty();
  EXPECT_EQ(empty, 5);
}

ModelSpec Spec() {
  ModelSpec s = BuildModelSpecFromJson("c.json", R"({"model_type":"deepseek_v3","num_hidden_layers":2,
    "hidden_size":24,"intermediate_size":40,"moe_intermediate_size":8,"num_attention_heads":3,"q_lora_rank":12,
    "kv_lora_rank":8,"qk_nope_head_dim":4,"qk_rope_head_dim":4,"v_head_dim":4,"n_routed_experts":5,
    "n_shared_experts":1,"first_k_dense_replace":1,"vocab_size":7,"max_position_embeddings":64})");
  return s;
}

TEST(Plan, PlacementsFollowRolesAndGlobalShapesStayExplicit) {
  ModelSpec spec = Spec();
  Plan plan = Plan::Build(spec, 4);
  const PlanEntry* embed = plan.Find("model.embed_tokens.weight");
  ASSERT_NE(embed, nullptr);
  EXPECT_FALSE(embed->replicated());
  EXPECT_EQ(embed->LocalShape(3), (std::vector<uint64_t>{1, 24}));  // 7 rows: 2, 2, 2, 1
  EXPECT_EQ(embed->shape, (std::vector<uint64_t>{7, 24}));
  const PlanEntry* bias = plan.Find("model.layers.1.mlp.gate.e_score_correction_bias");
  ASSERT_NE(bias, nullptr);
  EXPECT_TRUE(bias->replicated());
  EXPECT_EQ(bias->LocalShape(3), (std::vector<uint64_t>{5}));
  EXPECT_TRUE(plan.Find("model.rotary_emb.inv_freq")->replicated());
  // Every sharded byte lands on exactly one rank; replicated bytes on all.
  uint64_t sharded = 0, replicated = 0, summed = 0;
  for (const auto& e : plan.entries()) (e.replicated() ? replicated : sharded) += e.nbytes();
  for (int r = 0; r < 4; ++r) summed += plan.LocalBytes(r).total();
  EXPECT_EQ(summed, sharded + 4 * replicated);
}

TEST(Plan, ZeroRowRanksAreListed) {
  ModelSpec spec = Spec();
  Plan plan = Plan::Build(spec, 8);
  auto none = plan.EntriesWithoutRows(7);
  bool embed = false;
  for (const auto* e : none) embed |= e->key == "model.embed_tokens.weight";  // 7 rows over 8 ranks
  EXPECT_TRUE(embed);
  EXPECT_TRUE(plan.EntriesWithoutRows(0).empty());
}

TEST(Plan, BadInputNamesWhatIsWrong) {
  ModelSpec spec = Spec();
  EXPECT_SC_ERROR(Plan::Build(spec, 0), ErrorKind::kInvalidArgument, "world size must be at least 1, got 0");
  Plan plan = Plan::Build(spec, 2);
  EXPECT_SC_ERROR(plan.LocalBytes(2), ErrorKind::kInvalidArgument, "rank 2 is outside world size 2");
  PlanOptions opt;  // a placement on a dim the tensor does not have, and a rank outside the world
  opt.layouts = {Layout{{2}, {0, 1}, {Placement{Placement::kShard, 2, 1}}, {}}, Layout{{2}, {0, 5}, {Placement{}}, {}}};
  opt.layout_of["model.layers.0.mlp.up_proj.weight"] = 0;
  EXPECT_SC_ERROR(Plan::Build(spec, 2, opt), ErrorKind::kInvalidArgument, "model.layers.0.mlp.up_proj.weight",
                  "Shard(dim=2) of a tensor with 2 dim(s)");
  opt.layout_of["model.layers.0.mlp.up_proj.weight"] = 1;
  EXPECT_SC_ERROR(Plan::Build(spec, 2, opt), ErrorKind::kInvalidArgument, "model.layers.0.mlp.up_proj.weight",
                  "names rank 5 outside a world of 2");
  PlanOptions hsdp;
  hsdp.replicas = 3;
  EXPECT_SC_ERROR(Plan::Build(spec, 4, hsdp), ErrorKind::kInvalidArgument, "3 replicas do not divide a world of 4");
}

}  // namespace
}  // namespace shardcast
