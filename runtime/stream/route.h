// runtime/stream/route: for every message of the schedule, which rank reads it from storage and how its
// bytes reach the ranks that hold them (its holders: the replicas of its piece, from the entry's
// layout, or every rank for a broadcast). The stream has one loop; a source is a Route.
//
//   rank0        global rank 0 reads everything. A shard's rows go to its first holder, which forwards
//                them to the next replica, and so on: rank 0 never sends R copies. Replicated entries
//                are broadcast. Storage reads: 1x the checkpoint.
//   each-rank    every holder reads its own rows; nothing crosses the wire. Reads: R x.
//   node-leader  the lowest rank of each node reads the rows its node's ranks hold and sends them
//                within the node. Reads: 1x per node.
//   striped      each shard's rows are read by one of its holders, chosen round-robin by message, which
//                sends them to the other replicas; replicated entries are read by rank 0 and broadcast.
//                Reads: 1x, spread over every rank.
//
// Saves run the same schedule with the data flowing the other way: a piece's writer (its lowest
// holder: one writer per byte, whatever the replicas) "reads" it out of its own shards (ShardSource)
// and it is "kept" by writing it into the output files (FileSink).
//
//   save-rank0      each writer sends its pieces to the collector (rank 0), which writes every byte
//                   (node-local disks); broadcast entries are read and written by rank 0
//   save-each-rank  each writer writes its pieces into the shared files; nothing crosses the wire;
//                   broadcast entries are written by rank 0 alone
//
// With verify, the rank that reads a message also hashes it as the expected digests of the holders it
// serves (`verify_for`). each-rank has no sender, so there the next rank reads each rank's rows a
// second time, from its own view of the files. Everything is derived from the agreed manifest (its
// layouts) and node map alone.
//
// Thread safety: immutable; safe from any thread.
#pragma once

#include <memory>
#include <vector>

#include "runtime/layout/mesh.h"  // NodeMap
#include "runtime/stream/schedule.h"

namespace shardcast {

// What one rank does with one message.
struct Task {
  bool read = false;            // read it from storage (into a staging slot, or in place)
  bool keep = false;            // store its bytes in this rank's sink
  bool broadcast = false;       // a broadcast to every rank from `peer` (this rank, if it reads)
  bool receive = false;         // receive it point to point from `peer`
  int peer = -1;
  std::vector<int> send_to;     // send it point to point to these ranks, in order
  std::vector<int> verify_for;  // with verify: hash it as the expected digest of these ranks
  bool any() const { return read || receive || broadcast; }
};

class Route {
 public:
  Route(int world_size, const NodeMap& nodes) : world_(world_size), nodes_(nodes) {}
  virtual ~Route() = default;
  virtual const char* name() const = 0;
  // Whether `rank` reads anything from storage (and so must open the checkpoint and agree on files).
  virtual bool Reads(int rank, bool verify) const = 0;
  virtual Task For(const Message& msg, int rank, bool verify) const = 0;
  // Which messages `rank` takes part in: For(msg, rank).any() for some message of a piece held by
  // `holders` (TakesPart), or of a broadcast (TakesPartInBroadcasts). Asked once per holder set, so a
  // rank's schedule (Interest) skips the rest without walking it.
  virtual bool TakesPart(const std::vector<int>& holders, int rank, bool verify) const = 0;
  virtual bool TakesPartInBroadcasts(int rank, bool verify) const = 0;
  Interest InterestOf(int rank, bool verify) const;
  // With verify: the rank that hashes `msg` as the expected digest of `holder`, one of the ranks that
  // keep it (the one whose For(msg, .).verify_for names `holder`).
  virtual int VerifierOf(const Message& msg, int holder) const = 0;
  // Whether data crosses the wire during the stream (a failure then needs the store to agree).
  virtual bool Communicates() const = 0;
  int world_size() const { return world_; }

  static std::unique_ptr<Route> Make(Source source, int world_size, const NodeMap& nodes);
  enum class SaveMode { kCollector, kEachWriter };  // save-rank0 (rank 0 collects), save-each-rank
  static std::unique_ptr<Route> MakeSave(SaveMode mode, int world_size);

 protected:
  int world_;
  NodeMap nodes_;
};

}  // namespace shardcast
