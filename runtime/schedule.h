// runtime/schedule: the order in which a load moves bytes, derived by every rank from the agreed
// manifest alone (world size, chunk and coalescing are in it), so readers and receivers agree
// without exchanging it.
//
// Phase 1, broadcasts: each replicated entry (buffers, 0-dim, declared replicated) in chunks.
// Phase 2, scatter: consecutive sharded entries are batched up to world x chunk bytes; within a batch,
// for rank 0..W-1, that rank's rows of each entry form segments. A segment larger than the coalescing
// size is split into chunk-sized messages received straight into the destination; smaller ones are
// packed into one message (at most coalesce bytes) that the receiver unpacks.
//
//   entry A rows:  |-- r0 --|-- r1 --|-- r2 --|-r3-|     batch {A, B}: messages to r0: [A.r0, B.r0]
//   entry B rows:  |- r0 -|- r1 -|- r2 -|- r3 -|                       to r1: [A.r1, B.r1] ...
//
// Cuts fall on row boundaries of the checkpoint part (its own dim-0 rows), so a reader-side
// conversion (dtype, fp8 blocks) always sees whole rows: a part row larger than the chunk is one
// message of its own. Within a composed entry whose rank boundary does not fall on a part row, cuts
// fall on elements. Generated lazily, batch by batch: memory does not grow with the entry count.
//
// Worked example, n = 5 rows of 3 bf16 elements, W = 2, chunk = 8 bytes (one row is 6 bytes):
//   rank 0 holds rows [0, 3): messages rows {0}, {1}, {2};  rank 1 holds rows [3, 5): {3}, {4}
#pragma once

#include <cstdint>
#include <deque>
#include <vector>

#include "allocators/host_allocator.h"
#include "runtime/manifest.h"

namespace shardcast {

inline constexpr int kBroadcast = -1;

struct Segment {
  uint32_t entry = 0;          // index into manifest entries
  uint32_t part = 0;           // index into that entry's parts
  uint64_t first = 0;          // first element within the part
  uint64_t count = 0;          // elements
  uint64_t source_offset = 0;  // absolute file offset of element `first`
  uint64_t source_bytes = 0;
  uint64_t local_offset = 0;   // byte offset in the destination's local tensor
  uint64_t target_bytes = 0;
};

// Staging descriptors are many and small: they come from the mimalloc host allocator.
using SegmentList = std::vector<Segment, HostStlAllocator<Segment>>;

struct Message {
  uint64_t seq = 0;       // position in the schedule, from 0
  int dest = kBroadcast;  // a rank (its rows), or kBroadcast (a replicated entry: every rank)
  SegmentList segments;
  uint64_t target_bytes = 0;  // sum over segments: the bytes on the wire
  bool direct() const { return segments.size() == 1; }
};

class Schedule {
 public:
  explicit Schedule(const Manifest& m);
  bool Next(Message* out);  // false when done

 private:
  void FillBroadcast(uint32_t e);
  void FillBatch();
  void EmitRank(int r, const std::vector<uint32_t>& batch);
  void Split(uint32_t entry, int dest, uint64_t first, uint64_t n, uint64_t local_first);
  void Push(Message&& m);

  const Manifest& m_;
  int world_;
  uint64_t chunk_, coalesce_;
  uint32_t next_broadcast_ = 0, next_shard_ = 0;
  uint64_t seq_ = 0;
  std::deque<Message, HostStlAllocator<Message>> queue_;
};

}  // namespace shardcast
