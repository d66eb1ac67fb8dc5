#include "runtime/layout/mesh.h"

#include <unistd.h>

#include <cstdlib>
#include <functional>
#include <map>

#include "allocators/error.h"

namespace shardcast {

int NodeMap::nodes() const {
  int n = 0;
  for (int x : node_of_rank) n = std::max(n, x + 1);
  return n;
}

int NodeMap::LeaderOf(int node) const {
  for (size_t r = 0; r < node_of_rank.size(); ++r) {
    if (node_of_rank[r] == node) return static_cast<int>(r);
  }
  return -1;
}

long long LocalNodeKey() {
  for (const char* name : {"GROUP_RANK", "SLURM_NODEID"}) {
    const char* v = std::getenv(name);
    if (v != nullptr && *v != '\0') return std::atoll(v);
  }
  char host[256] = {0};
  gethostname(host, sizeof(host) - 1);
  // A hash well away from small node ranks; hosts are compared by it, so collisions only merge
  // nodes for node-leader (still correct: one more rank reads).
  return static_cast<long long>(std::hash<std::string>{}(host) | (1ull << 62));
}

NodeMap NodeMapFromKeys(const std::vector<long long>& keys) {
  NodeMap m;
  std::map<long long, int> index;
  for (long long k : keys) {
    auto it = index.find(k);
    if (it == index.end()) it = index.emplace(k, static_cast<int>(index.size())).first;
    m.node_of_rank.push_back(it->second);
  }
  return m;
}

}  // namespace shardcast
