#include "runtime/route.h"

#include <algorithm>

#include "allocators/error.h"

namespace shardcast {
namespace {

bool Contains(const std::vector<int>& v, int x) { return std::find(v.begin(), v.end(), x) != v.end(); }

std::vector<int> AllRanks(int world) {
  std::vector<int> out(world);
  for (int r = 0; r < world; ++r) out[r] = r;
  return out;
}

// Replicated entries, in every route but each-rank: rank 0 reads and broadcasts.
Task BroadcastFromRank0(int rank, int world, bool verify) {
  Task t;
  t.keep = t.broadcast = true;
  t.peer = 0;
  t.read = rank == 0;
  if (verify && rank == 0) t.verify_for = AllRanks(world);
  return t;
}

class Rank0Route : public Route {
 public:
  using Route::Route;
  const char* name() const override { return "rank0"; }
  bool Reads(int rank, bool) const override { return rank == 0; }
  bool Communicates() const override { return true; }
  std::vector<int> VerifiersOf(int) const override { return {0}; }
  Task For(const Message& msg, int rank, bool verify) const override {
    if (msg.dest == kBroadcast) return BroadcastFromRank0(rank, mesh_.world(), verify);
    const std::vector<int> holders = Holders(msg);
    std::vector<int> chain;  // the holders other than rank 0, each forwarding to the next
    for (int h : holders) {
      if (h != 0) chain.push_back(h);
    }
    Task t;
    if (rank == 0) {
      t.read = true;
      t.keep = Contains(holders, 0);
      if (!chain.empty()) t.send_to = {chain[0]};
      if (verify) t.verify_for = holders;
      return t;
    }
    for (size_t i = 0; i < chain.size(); ++i) {
      if (chain[i] != rank) continue;
      t.receive = t.keep = true;
      t.peer = i == 0 ? 0 : chain[i - 1];
      if (i + 1 < chain.size()) t.send_to = {chain[i + 1]};
    }
    return t;
  }
};

class EachRankRoute : public Route {
 public:
  using Route::Route;
  const char* name() const override { return "each-rank"; }
  bool Reads(int, bool) const override { return true; }
  bool Communicates() const override { return false; }
  std::vector<int> VerifiersOf(int rank) const override {
    const int next = (rank + 1) % mesh_.world();
    return next == 0 ? std::vector<int>{0} : std::vector<int>{0, next};  // rank 0 verifies broadcasts
  }
  Task For(const Message& msg, int rank, bool verify) const override {
    const int world = mesh_.world();
    const std::vector<int> holders = Holders(msg);
    Task t;
    t.peer = rank;
    t.keep = Contains(holders, rank);
    if (verify && msg.dest == kBroadcast && rank == 0) t.verify_for = holders;
    if (verify && msg.dest != kBroadcast) {
      for (int h : holders) {
        if ((h + 1) % world == rank) t.verify_for.push_back(h);
      }
    }
    t.read = t.keep || !t.verify_for.empty();
    return t;
  }
};

class NodeLeaderRoute : public Route {
 public:
  using Route::Route;
  const char* name() const override { return "node-leader"; }
  bool Reads(int rank, bool) const override { return nodes_.LeaderOf(nodes_.node_of_rank[rank]) == rank; }
  bool Communicates() const override { return true; }
  std::vector<int> VerifiersOf(int rank) const override { return {nodes_.LeaderOf(nodes_.node_of_rank[rank])}; }
  Task For(const Message& msg, int rank, bool verify) const override {
    const int node = nodes_.node_of_rank[rank], leader = nodes_.LeaderOf(node);
    std::vector<int> local;  // the holders on this node
    for (int h : Holders(msg)) {
      if (nodes_.node_of_rank[h] == node) local.push_back(h);
    }
    Task t;
    if (local.empty()) return t;
    if (rank == leader) {
      t.read = true;
      t.keep = Contains(local, rank);
      for (int h : local) {
        if (h != rank) t.send_to.push_back(h);
      }
      if (verify) t.verify_for = local;
    } else if (Contains(local, rank)) {
      t.receive = t.keep = true;
      t.peer = leader;
    }
    return t;
  }
};

class StripedRoute : public Route {
 public:
  using Route::Route;
  const char* name() const override { return "striped"; }
  bool Reads(int, bool) const override { return true; }
  bool Communicates() const override { return true; }
  std::vector<int> VerifiersOf(int rank) const override {
    std::vector<int> out = mesh_.Holders(mesh_.ShardOf(rank));
    if (!Contains(out, 0)) out.insert(out.begin(), 0);  // rank 0 reads the replicated entries
    return out;
  }
  Task For(const Message& msg, int rank, bool verify) const override {
    if (msg.dest == kBroadcast) return BroadcastFromRank0(rank, mesh_.world(), verify);
    const std::vector<int> holders = Holders(msg);
    const int reader = holders[msg.seq % holders.size()];
    Task t;
    if (rank == reader) {
      t.read = t.keep = true;
      for (int h : holders) {
        if (h != reader) t.send_to.push_back(h);
      }
      if (verify) t.verify_for = holders;
    } else if (Contains(holders, rank)) {
      t.receive = t.keep = true;
      t.peer = reader;
    }
    return t;
  }
};

// A save: the holder of a message's rows reads them from its shards. save-rank0 sends them to rank 0,
// which writes everything; save-each-rank writes them where they are. Replicated entries (kBroadcast)
// are read and written by rank 0 alone, once. Verify is not part of a save: no verifiers.
class SaveRoute : public Route {
 public:
  SaveRoute(bool each_rank, const Mesh& mesh) : Route(mesh, NodeMap{}), each_rank_(each_rank) {}
  const char* name() const override { return each_rank_ ? "save-each-rank" : "save-rank0"; }
  bool Reads(int, bool) const override { return true; }  // every rank may hold rows
  bool Communicates() const override { return !each_rank_; }
  std::vector<int> VerifiersOf(int) const override { return {}; }
  Task For(const Message& msg, int rank, bool) const override {
    Task t;
    const int holder = msg.dest == kBroadcast ? 0 : msg.dest;
    t.peer = holder;
    if (rank == holder) {
      t.read = true;
      t.keep = each_rank_ || holder == 0;
      if (!t.keep) t.send_to = {0};
    } else if (rank == 0 && !each_rank_) {
      t.receive = true;
      t.keep = true;
    }
    return t;
  }

 private:
  bool each_rank_;
};

}  // namespace

std::vector<int> Route::Holders(const Message& msg) const {
  if (msg.dest == kBroadcast) return AllRanks(mesh_.world());
  return mesh_.Holders(msg.dest);
}

std::unique_ptr<Route> Route::Make(Source source, const Mesh& mesh, const NodeMap& nodes) {
  switch (source) {
    case Source::kRank0: return std::make_unique<Rank0Route>(mesh, nodes);
    case Source::kEachRank: return std::make_unique<EachRankRoute>(mesh, nodes);
    case Source::kNodeLeader: return std::make_unique<NodeLeaderRoute>(mesh, nodes);
    case Source::kStriped: return std::make_unique<StripedRoute>(mesh, nodes);
  }
  throw Error(ErrorKind::kInternal, "route", "unknown source");
}

std::unique_ptr<Route> Route::MakeSave(bool each_rank, int world_size) {
  return std::make_unique<SaveRoute>(each_rank, Mesh{1, world_size});
}

}  // namespace shardcast
