// runtime/schedule: the order in which a load moves bytes, derived by every rank from the manifest
// alone, so sender and receivers agree without exchanging it.
//
// Phase 1, broadcasts: each replicated entry (buffers, 0-dim, declared replicated) in chunks.
// Phase 2, scatter: consecutive sharded entries are batched up to world x chunk bytes; within a batch,
// for rank 0..W-1, that rank's rows of each entry form segments. A segment larger than a chunk is
// split into chunk-sized messages received straight into the destination; small segments are
// coalesced into one message (at most coalesce_bytes) that the receiver unpacks.
//
//   entry A rows:  |-- r0 --|-- r1 --|-- r2 --|-r3-|     batch {A, B}: messages to r0: [A.r0, B.r0]
//   entry B rows:  |- r0 -|- r1 -|- r2 -|- r3 -|                       to r1: [A.r1, B.r1] ...
//
// Cuts fall on element boundaries of both the checkpoint's and the target dtype. Generated lazily,
// batch by batch: memory does not grow with the number of entries.
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
  uint64_t source_offset = 0;  // absolute file offset
  uint64_t source_bytes = 0;
  uint64_t local_offset = 0;   // byte offset in the destination's local tensor
  uint64_t target_bytes = 0;
};

// Staging descriptors are many and small: they come from the mimalloc host allocator.
using SegmentList = std::vector<Segment, HostStlAllocator<Segment>>;

struct Message {
  int dest = kBroadcast;  // a rank, or kBroadcast
  SegmentList segments;
  uint64_t target_bytes = 0;  // sum over segments: the bytes on the wire
  bool direct() const { return segments.size() == 1; }
};

class Schedule {
 public:
  Schedule(const Manifest& m, int world_size, uint64_t chunk_bytes, uint64_t coalesce_bytes = 4ull << 20);
  bool Next(Message* out);  // false when done

 private:
  void FillBroadcast(uint32_t e);
  void FillBatch();
  void EmitRank(int r, const std::vector<uint32_t>& batch);

  const Manifest& m_;
  int world_;
  uint64_t chunk_, coalesce_;
  uint32_t next_broadcast_ = 0, next_shard_ = 0;
  std::deque<Message, HostStlAllocator<Message>> queue_;
};

}  // namespace shardcast
