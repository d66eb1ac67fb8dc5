// HSDP meshes (replicate R x shard S) and read-once sources over two "nodes" on one machine (groups
// of ranks with their own LOCAL_RANK / LOCAL_WORLD_SIZE / GROUP_RANK, as torchrun --nnodes gives
// them): every source bit-exact on every rank, each reading storage the number of times it promises.
#include <gtest/gtest.h>
#include <signal.h>

#include <tuple>

#include "runtime/handshake.h"
#include "tests/runtime/load_harness.h"

namespace shardcast {
namespace {

struct MeshCase {
  int replicas, shards, nodes;
};

std::function<std::vector<std::string>(int)> NodeEnv(const MeshCase& m, std::vector<std::string> extra = {}) {
  return [m, extra](int rank) {
    const int world = m.replicas * m.shards, per_node = world / m.nodes;
    std::vector<std::string> env = {"TEST_REPLICAS=" + std::to_string(m.replicas),
                                    "LOCAL_RANK=" + std::to_string(rank % per_node),
                                    "LOCAL_WORLD_SIZE=" + std::to_string(per_node),
                                    "GROUP_RANK=" + std::to_string(rank / per_node)};
    env.insert(env.end(), extra.begin(), extra.end());
    return env;
  };
}

class Hsdp : public LoadTest, public ::testing::WithParamInterface<std::tuple<MeshCase, const char*>> {};

TEST_P(Hsdp, EveryRankHoldsItsShardIndexsRowsAndStorageIsReadAsPromised) {
  const auto [mesh, source] = GetParam();
  const int world = mesh.replicas * mesh.shards;
  auto rs = Run(world, "exact", "qwen", "qwen", source, nullptr, NodeEnv(mesh));
  for (int r = 0; r < world; ++r) {
    ASSERT_TRUE(rs[r].ok) << "rank " << r << ": " << rs[r].kind << ": " << rs[r].message;
    EXPECT_GT(rs[r].checked, 0);
    EXPECT_EQ(rs[r].mismatches, 0) << "rank " << r;
    EXPECT_EQ(rs[r].verified, 1) << "rank " << r;
    EXPECT_EQ(rs[r].nodes, mesh.nodes);
  }
  // Storage reads as a multiple of the checkpoint (with verify, each-rank reads every byte twice:
  // once by its holder and once by the next rank, which checks it).
  const double multiple = static_cast<double>(rs[0].read_total) / rs[0].checkpoint_bytes;
  const std::string s = source;
  if (s == "node-leader" && mesh.replicas < mesh.nodes) {
    // A node reads only the rows its ranks hold: with one replica spread over two nodes, each shard's
    // rows once, and only the replicated entries on both nodes.
    EXPECT_GE(multiple, 1.0);
    EXPECT_LT(multiple, 1.05);
    return;
  }
  const double want = s == "rank0" || s == "striped" ? 1.0 : s == "node-leader" ? mesh.nodes : 2.0 * mesh.replicas;
  EXPECT_NEAR(multiple, want, 1e-9) << source << " on " << rs[0].mesh;
}

INSTANTIATE_TEST_SUITE_P(
    Meshes, Hsdp,
    ::testing::Combine(::testing::Values(MeshCase{2, 2, 2}, MeshCase{2, 3, 2}, MeshCase{1, 4, 2}),
                       ::testing::Values("rank0", "each-rank", "node-leader", "striped")),
    [](const auto& info) {
      const MeshCase m = std::get<0>(info.param);
      std::string source = std::get<1>(info.param);
      for (char& c : source) c = c == '-' ? '_' : c;
      return std::to_string(m.replicas) + "x" + std::to_string(m.shards) + "_" + source;
    });

TEST_F(LoadTest, AReplicaWhoseShapesDisagreeIsTheSameErrorEverywhere) {
  for (const char* source : {"rank0", "striped"}) {
    auto rs = Run(6, "shape_divergence", "qwen", "qwen", source, nullptr, NodeEnv({2, 3, 2}));
    ExpectSameError(rs, "ManifestMismatch", {"[rank 5]", "model.layers.1.mlp.gate.weight", "shape [5, 48] on rank 0"});
  }
}

TEST_F(LoadTest, ARankKilledInTheOtherNodeEndsEveryRank) {
  for (const char* source : {"node-leader", "striped", "rank0"}) {
    auto rs = Run(4, "exact", "slow", "slow", source, nullptr,
                  NodeEnv({2, 2, 2}, {"SHARDCAST_FAULT=3:stream:kill:2", "SHARDCAST_TIMEOUT_MS=5000"}), {3});
    EXPECT_FALSE(rs[3].reported);
    ExpectSameError(rs, rs[0].kind.c_str(), {}, {3});
    for (int r : {0, 1, 2}) EXPECT_LT(rs[r].seconds, 5 + 14.0) << source << " rank " << r;
  }
}

// source=auto: rank 0 decides from who sees the files, the nodes and the layout; every rank runs the
// choice, says why, and holds exactly its rows.
struct AutoCase {
  const char* name;
  MeshCase mesh;
  const char* scenario;  // "blind": the last rank does not see the checkpoint
  const char* source;    // what rank 0 must choose
  const char* reason;    // in the report's reason
};

class Auto : public LoadTest, public ::testing::WithParamInterface<AutoCase> {};

TEST_P(Auto, RankZeroChoosesFromWhatEveryRankSeesAndEveryRankRunsIt) {
  const AutoCase c = GetParam();
  const int world = c.mesh.replicas * c.mesh.shards;
  auto rs = Run(world, c.scenario, "qwen", "qwen", "auto", nullptr, NodeEnv(c.mesh));
  for (int r = 0; r < world; ++r) {
    ASSERT_TRUE(rs[r].ok) << "rank " << r << ": " << rs[r].kind << ": " << rs[r].message;
    EXPECT_GT(rs[r].checked, 0);
    EXPECT_EQ(rs[r].mismatches, 0) << "rank " << r;
    EXPECT_EQ(rs[r].source, c.source) << "rank " << r;
    EXPECT_NE(rs[r].source_reason.find(c.reason), std::string::npos) << "rank " << r << ": " << rs[r].source_reason;
    EXPECT_TRUE(rs[r].adopted.empty()) << "auto asked for no source, so none was overruled";
  }
}

INSTANTIATE_TEST_SUITE_P(
    Choices, Auto,
    ::testing::Values(AutoCase{"one_node", {1, 3, 1}, "exact", "each-rank", "auto: every rank sees the checkpoint, on one node"},
                      AutoCase{"two_nodes_fsdp", {1, 4, 2}, "exact", "node-leader", "on 2 nodes"},
                      AutoCase{"two_nodes_hsdp", {2, 2, 2}, "exact", "striped", "2.0 copies of each shard (HSDP)"},
                      AutoCase{"one_node_blind_rank", {1, 3, 1}, "blind", "rank0", "rank(s) 2 do not see it"},
                      AutoCase{"two_nodes_blind_rank", {1, 4, 2}, "blind", "node-leader",
                               "rank(s) 3 do not see it as rank 0 does; the first rank of every node does"}),
    [](const auto& info) { return std::string(info.param.name); });

TEST(ChooseSource, FollowsWhoSeesTheFilesTheNodesAndTheCopies) {
  const NodeMap one = NodeMapFromKeys({7, 7, 7, 7}), two = NodeMapFromKeys({0, 0, 1, 1});
  EXPECT_EQ(ChooseSource({10, 10, 10, 10}, one, 1.0).source, Source::kEachRank);
  EXPECT_EQ(ChooseSource({10, 10, 10, 10}, two, 1.0).source, Source::kNodeLeader);
  EXPECT_EQ(ChooseSource({10, 10, 10, 10}, two, 2.0).source, Source::kStriped);
  const SourceChoice c = ChooseSource({10, 10, -1, -1}, one, 1.0);
  EXPECT_EQ(c.source, Source::kRank0);
  EXPECT_EQ(c.reason, "rank(s) 2, 3 do not see it as rank 0 does");
  // Another size sees a checkpoint all the same (it was taken for blind and served rank 0's values): it
  // reads its own, and the handshake's file match decides.
  EXPECT_EQ(ChooseSource({10, 10, 11, 10}, one, 1.0).source, Source::kEachRank);
  EXPECT_EQ(ChooseSource({10, 10, 11, -1}, one, 1.0).reason, "rank(s) 3 do not see it as rank 0 does");
  EXPECT_EQ(ChooseSource({10, -1, 10, -1}, two, 1.0).source, Source::kNodeLeader);
  EXPECT_EQ(ChooseSource({10, -1, -1, 10}, two, 1.0).source, Source::kRank0);
  EXPECT_EQ(ChooseSource({10}, NodeMapFromKeys({3}), 1.0).source, Source::kEachRank);
}

}  // namespace
}  // namespace shardcast
