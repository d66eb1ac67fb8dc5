// runtime/layout/mesh: which ranks share a machine (torchrun's GROUP_RANK, SLURM's SLURM_NODEID, else the host
// name), gathered from every rank, so read-once sources can read once per node. Where each rank sits
// in a device mesh is the entries' layouts' business (runtime/layout/layout.h).
//
// Thread safety: immutable values.
#pragma once

#include <string>
#include <vector>

namespace shardcast {

struct NodeMap {
  std::vector<int> node_of_rank;  // node index (0..nodes-1, in order of first rank) for every rank
  int nodes() const;
  int LeaderOf(int node) const;          // the lowest rank on the node
};

// This process's node key from its environment: GROUP_RANK, SLURM_NODEID, or a hash of the host name.
long long LocalNodeKey();
// Builds the map from every rank's key (in rank order).
NodeMap NodeMapFromKeys(const std::vector<long long>& keys);

}  // namespace shardcast
