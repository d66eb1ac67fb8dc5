#include "runtime/route.h"

namespace shardcast {
namespace {

bool Holds(const Message& msg, int rank) { return msg.dest == rank || msg.dest == kBroadcast; }

class Rank0Route : public Route {
 public:
  const char* name() const override { return "rank0"; }
  bool Reads(int rank, bool) const override { return rank == 0; }
  bool Communicates() const override { return true; }
  std::vector<int> VerifiersOf(int) const override { return {0}; }
  Task For(const Message& msg, int rank, bool verify) const override {
    Task t;
    t.peer = 0;
    if (rank == 0) {
      t.read = true;
      t.keep = Holds(msg, 0);
      t.broadcast = msg.dest == kBroadcast;
      if (!t.broadcast && msg.dest != 0) t.send_to = msg.dest;
      t.verify = verify;
    } else if (Holds(msg, rank)) {
      t.keep = true;
      t.broadcast = msg.dest == kBroadcast;
      t.receive = !t.broadcast;
    }
    return t;
  }
};

class EachRankRoute : public Route {
 public:
  explicit EachRankRoute(int world) : world_(world) {}
  const char* name() const override { return "each-rank"; }
  bool Reads(int, bool) const override { return true; }
  bool Communicates() const override { return false; }
  std::vector<int> VerifiersOf(int dest) const override {
    const int next = (dest + 1) % world_;
    if (next == 0) return {0};
    return {0, next};  // rank 0 verifies broadcast entries for everyone
  }
  Task For(const Message& msg, int rank, bool verify) const override {
    Task t;
    t.peer = rank;
    t.keep = Holds(msg, rank);
    // The verifier of a rank's rows is the next rank; of a broadcast entry's, rank 0 for every rank.
    const bool verifier = verify && (msg.dest == kBroadcast ? rank == 0 : (msg.dest + 1) % world_ == rank);
    t.verify = verifier;
    t.read = t.keep || verifier;
    return t;
  }

 private:
  int world_;
};

// A save: the holder of a message's rows reads them from its shards. save-rank0 sends them to rank 0,
// which writes everything; save-each-rank writes them where they are. Replicated entries (kBroadcast)
// are read and written by rank 0 alone, once. Verify is not part of a save: no verifiers.
class SaveRoute : public Route {
 public:
  explicit SaveRoute(bool each_rank) : each_rank_(each_rank) {}
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
      if (!t.keep) t.send_to = 0;
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

std::unique_ptr<Route> Route::Make(Kind kind, int world_size) {
  switch (kind) {
    case Kind::kSaveRank0: return std::make_unique<SaveRoute>(false);
    case Kind::kSaveEachRank: return std::make_unique<SaveRoute>(true);
    case Kind::kEachRank: return std::make_unique<EachRankRoute>(world_size);
    case Kind::kRank0: break;
  }
  return std::make_unique<Rank0Route>();
}

std::unique_ptr<Route> Route::Make(Source source, int world_size) {
  if (source == Source::kEachRank) return std::make_unique<EachRankRoute>(world_size);
  return std::make_unique<Rank0Route>();
}

}  // namespace shardcast
