// runtime/route: for every message of the schedule, which rank reads it from storage and how its
// bytes reach the rank(s) that hold them. The stream has one loop; a source is a Route.
//
//   rank0       rank 0 reads every message; it keeps its own rows, sends each other rank its rows
//               (point to point) and broadcasts replicated entries.
//   each-rank   every rank reads the messages it holds itself; nothing crosses the wire.
//
// Saves run the same schedule with the data flowing the other way: a rank "reads" its rows out of
// its own shards (ShardSource) and "keeps" them by writing them into the output files (FileSink).
//
//   save-rank0      each rank reads its own rows and sends them to rank 0, which writes every byte
//                   (node-local disks); rank 0 reads and writes its own rows and every replicated entry
//   save-each-rank  each rank writes its own rows into the shared files; nothing crosses the wire;
//                   replicated entries are written by rank 0 alone
//
// With verify, a message's bytes are also hashed by a verifier: the reader for rank0 (it hashes what
// it sends); for each-rank the next rank, which reads the same bytes a second time from its own view
// of the files, so a rank whose files differ is caught. Every rank derives all of this from the
// manifest alone.
//
// Thread safety: immutable; safe from any thread.
#pragma once

#include <memory>
#include <vector>

#include "runtime/schedule.h"

namespace shardcast {

// What one rank does with one message.
struct Task {
  bool read = false;       // read it from storage (into a staging slot, or in place)
  bool keep = false;       // store its bytes in this rank's sink
  int send_to = -1;        // send it point to point to this rank (-1: no)
  bool broadcast = false;  // broadcast it (as root if read, else as a receiver)
  bool receive = false;    // receive it from `peer`
  bool verify = false;     // hash it as the expected digest of msg.dest (or of every rank, if broadcast)
  int peer = -1;           // the reader, for receive and broadcast (the root)
  bool any() const { return read || receive || broadcast; }
};

class Route {
 public:
  virtual ~Route() = default;
  virtual const char* name() const = 0;
  // Whether `rank` reads anything from storage (and so must open the checkpoint and agree on files).
  virtual bool Reads(int rank, bool verify) const = 0;
  virtual Task For(const Message& msg, int rank, bool verify) const = 0;
  // Whether data crosses the wire during the stream (a failure then needs the store to agree).
  virtual bool Communicates() const = 0;
  // The ranks that hash expected digests for the rows `dest` holds (verify).
  virtual std::vector<int> VerifiersOf(int dest) const = 0;

  static std::unique_ptr<Route> Make(Source source, int world_size);
  // The load routes by source, and the save routes.
  enum class Kind { kRank0, kEachRank, kSaveRank0, kSaveEachRank };
  static std::unique_ptr<Route> Make(Kind kind, int world_size);
};

}  // namespace shardcast
