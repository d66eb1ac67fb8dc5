#include "runtime/stream/route.h"

#include <algorithm>
#include <map>
#include <string>

#include "allocators/error.h"

namespace shardcast {
namespace {

bool Contains(const std::vector<int>& v, int x) { return std::find(v.begin(), v.end(), x) != v.end(); }

std::vector<int> AllRanks(int world) {
  std::vector<int> out(world);
  for (int r = 0; r < world; ++r) out[r] = r;
  return out;
}

constexpr int kCoordinator = 0;  // reads broadcast entries in read-once routes; collects save-rank0

// Broadcast entries, in every route but each-rank: the coordinator reads and broadcasts.
Task BroadcastFromCoordinator(int rank, int world, bool verify) {
  Task t;
  t.keep = t.broadcast = true;
  t.peer = kCoordinator;
  t.read = rank == kCoordinator;
  if (verify && rank == kCoordinator) t.verify_for = AllRanks(world);
  return t;
}

class Rank0Route : public Route {
 public:
  using Route::Route;
  const char* name() const override { return "rank0"; }
  bool Reads(int rank, bool) const override { return rank == kCoordinator; }
  bool Communicates() const override { return true; }
  bool TakesPart(const std::vector<int>& holders, int rank, bool) const override {
    return rank == kCoordinator || Contains(holders, rank);
  }
  bool TakesPartInBroadcasts(int, bool) const override { return true; }
  int VerifierOf(const Message&, int) const override { return kCoordinator; }
  Task For(const Message& msg, int rank, bool verify) const override {
    if (msg.dest == kBroadcast) return BroadcastFromCoordinator(rank, world_, verify);
    const std::vector<int>& holders = *msg.holders;
    std::vector<int> chain;  // the holders other than the reader, each forwarding to the next
    for (int h : holders) {
      if (h != kCoordinator) chain.push_back(h);
    }
    Task t;
    if (rank == kCoordinator) {
      t.read = true;
      t.keep = Contains(holders, kCoordinator);
      if (!chain.empty()) t.send_to = {chain[0]};
      if (verify) t.verify_for = holders;
      return t;
    }
    for (size_t i = 0; i < chain.size(); ++i) {
      if (chain[i] != rank) continue;
      t.receive = t.keep = true;
      t.peer = i == 0 ? kCoordinator : chain[i - 1];
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
  // Without a sender, the next rank reads a holder's rows a second time to hash them.
  int Next(int holder) const { return (holder + 1) % world_; }
  bool TakesPart(const std::vector<int>& holders, int rank, bool verify) const override {
    return Contains(holders, rank) || (verify && Contains(holders, (rank + world_ - 1) % world_));
  }
  bool TakesPartInBroadcasts(int, bool) const override { return true; }
  int VerifierOf(const Message& msg, int holder) const override {
    return msg.dest == kBroadcast ? kCoordinator : Next(holder);
  }
  Task For(const Message& msg, int rank, bool verify) const override {
    Task t;
    t.peer = rank;
    if (msg.dest == kBroadcast) {
      t.keep = true;
      if (verify && rank == kCoordinator) t.verify_for = AllRanks(world_);
    } else {
      t.keep = Contains(*msg.holders, rank);
      if (verify) {
        for (int h : *msg.holders) {
          if (Next(h) == rank) t.verify_for.push_back(h);
        }
      }
    }
    t.read = t.keep || !t.verify_for.empty();
    return t;
  }
};

class NodeLeaderRoute : public Route {
 public:
  NodeLeaderRoute(int world, const NodeMap& nodes) : Route(world, nodes), leader_(world) {
    for (int r = world - 1; r >= 0; --r) first_[nodes.node_of_rank[r]] = r;
    for (int r = 0; r < world; ++r) leader_[r] = first_[nodes.node_of_rank[r]];
  }
  const char* name() const override { return "node-leader"; }
  bool Reads(int rank, bool) const override { return leader_[rank] == rank; }
  bool Communicates() const override { return true; }
  bool TakesPart(const std::vector<int>& holders, int rank, bool) const override {
    for (int h : holders) {
      if (h == rank || (leader_[rank] == rank && leader_[h] == rank)) return true;
    }
    return false;
  }
  bool TakesPartInBroadcasts(int, bool) const override { return true; }
  int VerifierOf(const Message&, int holder) const override { return leader_[holder]; }
  Task For(const Message& msg, int rank, bool verify) const override {
    const int leader = leader_[rank];
    std::vector<int> local;  // the holders on this node
    if (msg.dest == kBroadcast) {
      for (int h = 0; h < world_; ++h) {
        if (leader_[h] == leader) local.push_back(h);
      }
    } else {
      for (int h : *msg.holders) {
        if (leader_[h] == leader) local.push_back(h);
      }
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

 private:
  std::map<int, int> first_;  // node -> its lowest rank
  std::vector<int> leader_;   // by rank: its node's leader
};

class StripedRoute : public Route {
 public:
  using Route::Route;
  const char* name() const override { return "striped"; }
  bool Reads(int, bool) const override { return true; }
  bool Communicates() const override { return true; }
  bool TakesPart(const std::vector<int>& holders, int rank, bool) const override { return Contains(holders, rank); }
  bool TakesPartInBroadcasts(int, bool) const override { return true; }
  static int Reader(const Message& msg) { return (*msg.holders)[msg.seq % msg.holders->size()]; }
  int VerifierOf(const Message& msg, int) const override { return msg.dest == kBroadcast ? kCoordinator : Reader(msg); }
  Task For(const Message& msg, int rank, bool verify) const override {
    if (msg.dest == kBroadcast) return BroadcastFromCoordinator(rank, world_, verify);
    const std::vector<int>& holders = *msg.holders;
    const int reader = Reader(msg);
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

// A save: a piece's writer is its lowest holder, which reads it from its shards. save-rank0 sends it
// to the collector, which writes everything; save-each-rank writes it where it is. Broadcast entries
// are read and written by the collector alone, once. Verify is not part of a save.
class SaveRoute : public Route {
 public:
  SaveRoute(SaveMode mode, int world) : Route(world, NodeMap{}), mode_(mode) {}
  const char* name() const override { return mode_ == SaveMode::kEachWriter ? "save-each-rank" : "save-rank0"; }
  bool Reads(int, bool) const override { return true; }  // every rank may hold pieces
  bool Communicates() const override { return mode_ == SaveMode::kCollector; }
  bool TakesPart(const std::vector<int>& holders, int rank, bool) const override {
    return holders.front() == rank || (rank == kCoordinator && mode_ == SaveMode::kCollector);
  }
  bool TakesPartInBroadcasts(int rank, bool) const override { return rank == kCoordinator; }
  int VerifierOf(const Message&, int) const override { return kCoordinator; }  // a save does not verify
  Task For(const Message& msg, int rank, bool) const override {
    Task t;
    const int writer = msg.dest == kBroadcast ? kCoordinator : msg.dest;  // dest: the lowest holder
    const bool each = mode_ == SaveMode::kEachWriter;
    t.peer = writer;
    if (rank == writer) {
      t.read = true;
      t.keep = each || writer == kCoordinator;
      if (!t.keep) t.send_to = {kCoordinator};
    } else if (rank == kCoordinator && !each) {
      t.receive = true;
      t.keep = true;
    }
    return t;
  }

 private:
  SaveMode mode_;
};

}  // namespace

Interest Route::InterestOf(int rank, bool verify) const {
  Interest in;
  in.pieces = [this, rank, verify](const std::vector<int>& holders) { return TakesPart(holders, rank, verify); };
  in.broadcasts = TakesPartInBroadcasts(rank, verify);
  return in;
}

std::unique_ptr<Route> Route::Make(Source source, int world, const NodeMap& nodes) {
  switch (source) {
    case Source::kRank0: return std::make_unique<Rank0Route>(world, nodes);
    case Source::kEachRank: return std::make_unique<EachRankRoute>(world, nodes);
    case Source::kNodeLeader: return std::make_unique<NodeLeaderRoute>(world, nodes);
    case Source::kStriped: return std::make_unique<StripedRoute>(world, nodes);
    case Source::kAuto: break;  // rank 0 resolves auto in the handshake; a manifest never carries it
  }
  throw Error(ErrorKind::kInternal, "route", std::string("no route for source ") + SourceName(source));
}

std::unique_ptr<Route> Route::MakeSave(SaveMode mode, int world_size) {
  return std::make_unique<SaveRoute>(mode, world_size);
}

}  // namespace shardcast
