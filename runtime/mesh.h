// runtime/mesh: where each rank sits. FSDP2's 1-D mesh shards every entry over all W ranks; HSDP's
// 2-D mesh (replicate R x shard S, torch's init_device_mesh(..., (R, S))) shards over S ranks and keeps
// R replicas of each shard. Rank g is (replica g / S, shard index g % S), the layout of a DeviceMesh
// made by init_device_mesh. Shard math runs over S; replicas of one shard index hold the same rows.
//
//   W = 6, R = 2, S = 3        shard 0   shard 1   shard 2
//            replica 0         rank 0    rank 1    rank 2
//            replica 1         rank 3    rank 4    rank 5
//
// Nodes: which ranks share a machine (torchrun's GROUP_RANK, SLURM's SLURM_NODEID, else the host
// name), gathered from every rank, so read-once sources can read once per node.
//
// Thread safety: immutable values.
#pragma once

#include <string>
#include <vector>

namespace shardcast {

struct Mesh {
  int replicas = 1;  // R; 1 for a plain FSDP2 mesh
  int shards = 1;    // S
  int world() const { return replicas * shards; }
  int ShardOf(int rank) const { return rank % shards; }
  int ReplicaOf(int rank) const { return rank / shards; }
  int RankOf(int replica, int shard) const { return replica * shards + shard; }
  // The ranks that hold shard index `shard`, in replica order.
  std::vector<int> Holders(int shard) const;
  std::string Text() const;  // "2 x 3 (replicate x shard)" or "1-D, 4 ranks"
};

// Mesh{1, world} for FSDP, or R x (world / R); throws kInvalidArgument when R does not divide world.
Mesh MakeMesh(int world_size, int replicas);

struct NodeMap {
  std::vector<int> node_of_rank;  // node index (0..nodes-1, in order of first rank) for every rank
  int nodes() const;
  int LeaderOf(int node) const;          // the lowest rank on the node
  std::vector<int> RanksOn(int node) const;
};

// This process's node key from its environment: GROUP_RANK, SLURM_NODEID, or a hash of the host name.
long long LocalNodeKey();
// Builds the map from every rank's key (in rank order).
NodeMap NodeMapFromKeys(const std::vector<long long>& keys);

}  // namespace shardcast
