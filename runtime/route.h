// runtime/route: for every message of the schedule, which rank reads it from storage and how its
// bytes reach the ranks that hold them (its holders: the R replicas of its shard index, or every rank
// for a replicated entry). The stream has one loop; a source is a Route.
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
// Saves run the same schedule with the data flowing the other way: a rank "reads" its rows out of
// its own shards (ShardSource) and "keeps" them by writing them into the output files (FileSink).
//
//   save-rank0      each rank reads its own rows and sends them to rank 0, which writes every byte
//                   (node-local disks); rank 0 reads and writes its own rows and every replicated entry
//   save-each-rank  each rank writes its own rows into the shared files; nothing crosses the wire;
//                   replicated entries are written by rank 0 alone
//
// With verify, the rank that reads a message also hashes it as the expected digests of the holders it
// serves (`verify_for`). each-rank has no sender, so there the next rank reads each rank's rows a
// second time, from its own view of the files. Everything is derived from the agreed manifest, mesh
// and node map alone.
//
// Thread safety: immutable; safe from any thread.
#pragma once

#include <memory>
#include <vector>

#include "runtime/mesh.h"
#include "runtime/schedule.h"

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
  Route(const Mesh& mesh, const NodeMap& nodes) : mesh_(mesh), nodes_(nodes) {}
  virtual ~Route() = default;
  virtual const char* name() const = 0;
  // Whether `rank` reads anything from storage (and so must open the checkpoint and agree on files).
  virtual bool Reads(int rank, bool verify) const = 0;
  virtual Task For(const Message& msg, int rank, bool verify) const = 0;
  // Whether data crosses the wire during the stream (a failure then needs the store to agree).
  virtual bool Communicates() const = 0;
  // The ranks that hash expected digests for the rows `rank` holds (verify).
  virtual std::vector<int> VerifiersOf(int rank) const = 0;

  // The ranks that keep `msg`: its shard index's replicas, or every rank for a replicated entry.
  std::vector<int> Holders(const Message& msg) const;
  const Mesh& mesh() const { return mesh_; }

  static std::unique_ptr<Route> Make(Source source, const Mesh& mesh, const NodeMap& nodes);
  // save-each-rank (each_rank) or save-rank0, over a 1-D mesh of `world_size` ranks.
  static std::unique_ptr<Route> MakeSave(bool each_rank, int world_size);

 protected:
  Mesh mesh_;
  NodeMap nodes_;
};

}  // namespace shardcast
