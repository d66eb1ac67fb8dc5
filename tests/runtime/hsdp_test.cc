// HSDP meshes (replicate R x shard S) and read-once sources over two "nodes" on one machine (groups
// of ranks with their own LOCAL_RANK / LOCAL_WORLD_SIZE / GROUP_RANK, as torchrun --nnodes gives
// them): every source bit-exact on every rank, each reading storage the number of times it promises.
#include <gtest/gtest.h>
#include <signal.h>

#include <tuple>

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

}  // namespace
}  // namespace shardcast
