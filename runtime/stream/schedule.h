// runtime/stream/schedule: the order in which a load moves bytes, derived by every rank from the agreed
// manifest alone (world size, layouts, chunk and coalescing are in it), so readers and receivers agree
// without exchanging it.
//
// Every entry's layout gives its distinct pieces and their holders (runtime/layout/layout.h: Holdings).
// Phase 1, broadcasts: each entry that every rank holds whole, in chunks.
// Phase 2, pieces: consecutive other entries are batched up to world x chunk bytes; within a batch the
// pieces are grouped by holder set (one rank for FSDP, a replica group for HSDP, a TP x FSDP coordinate
// ...), in order of first appearance, and for each group its pieces of each entry form segments. A
// piece larger than the coalescing size is split into chunk-sized messages (received straight into
// the destination where its local bytes are contiguous); smaller ones are packed into one message (at
// most coalesce bytes) that the receiver unpacks.
//
//   entry A rows:  |-- r0 --|-- r1 --|-- r2 --|-r3-|     batch {A, B}: messages to r0: [A.r0, B.r0]
//   entry B rows:  |- r0 -|- r1 -|- r2 -|- r3 -|                       to r1: [A.r1, B.r1] ...
//
// A segment is a strided window of one checkpoint part: `runs` runs of `count` elements, `stride` apart
// in the part, landing `local_stride` bytes apart in the local tensor and packed back to back on the
// wire. A Shard(0) piece is one run; Shard(1) of a matrix is one run per row:
//
//   part [4 rows x 6 cols], rank 1 of Shard(1) over 3:   . . X X . .   segment: first 2, count 2,
//                                                         . . X X . .            runs 4, stride 6
//
// Cuts fall on row boundaries of the checkpoint part (its own dim-0 rows) where a piece allows it, so
// a reader-side conversion (dtype, fp8 blocks) mostly sees whole rows; a part row larger than the
// chunk is one message of its own. Generated lazily, batch by batch: memory does not grow with the
// entry count.
//
// Worked example, n = 5 rows of 3 bf16 elements, W = 2, chunk = 8 bytes (one row is 6 bytes):
//   rank 0 holds rows [0, 3): messages rows {0}, {1}, {2};  rank 1 holds rows [3, 5): {3}, {4}
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <vector>

#include "allocators/host_allocator.h"
#include "runtime/manifest/manifest.h"

namespace shardcast {

inline constexpr int kBroadcast = -1;

struct Segment {
  uint32_t entry = 0;          // index into manifest entries
  uint32_t part = 0;           // index into that entry's parts
  uint64_t first = 0;          // first element within the part (of run 0)
  uint64_t count = 0;          // elements per run
  uint64_t runs = 1;           // runs of `count` elements
  uint64_t stride = 0;         // elements between the starts of consecutive runs in the part
  uint64_t source_offset = 0;  // absolute file offset of element `first`
  uint64_t source_bytes = 0;   // runs x count in the part's dtype: what is read
  uint64_t local_offset = 0;   // byte offset of run 0 in the destination's local tensor
  uint64_t local_stride = 0;   // bytes between the starts of consecutive runs in the local tensor
  uint64_t target_bytes = 0;   // runs x count in the entry's dtype: on the wire, back to back
  uint64_t run_bytes() const { return target_bytes / runs; }
  bool local_contiguous() const { return runs == 1 || local_stride == run_bytes(); }
  bool source_contiguous() const { return runs == 1 || stride == count; }
};

// Staging descriptors are many and small: they come from the mimalloc host allocator.
using SegmentList = std::vector<Segment, HostStlAllocator<Segment>>;

struct Message {
  uint64_t seq = 0;       // position in the schedule, from 0
  int dest = kBroadcast;  // kBroadcast (an entry every rank holds whole), or the lowest of its holders
  std::shared_ptr<const std::vector<int>> holders;  // the ranks that keep it, ascending (not for broadcasts)
  SegmentList segments;
  uint64_t target_bytes = 0;  // sum over segments: the bytes on the wire
  // One segment whose bytes land contiguously: it can be received in place.
  bool direct() const { return segments.size() == 1 && segments[0].local_contiguous(); }
};

// Which messages a rank takes part in (route.h derives it from its route): a predicate on a piece's
// holder set, asked once per distinct set, and whether it takes part in the broadcasts. Default: all.
struct Interest {
  std::function<bool(const std::vector<int>& holders)> pieces;  // empty: every piece
  bool broadcasts = true;
};

// The schedule, or one rank's part of it. A rank's part keeps every message's seq, bytes and order as
// in the whole schedule: a batch's groups are counted from their pieces' sizes alone (one state per
// run of holder sets that every entry treats alike, so the count does not grow with the world), and
// only the groups the rank takes part in are cut into segments.
//
//   batch {A, B}, W = 4, groups in order of first appearance:   {0}  {1}  {2}  {3}
//   messages per group (counted, not cut):                        2    2    2    1
//   rank 2's part: seqs base+4, base+5 cut; the others skipped by count
//
// Thread safety: one thread at a time. Failure: kInternal if a count and a cut disagree.
class Schedule {
 public:
  explicit Schedule(const Manifest& m, Interest interest = {});
  bool Next(Message* out);  // false when done

 private:
  // An entry's holdings, shared by every entry of the same shape and layout. Only the pieces this part
  // cuts are kept (its wanted holder sets', and a broadcast's one); the others are counted from a
  // Holdings computed again when a new Counted needs them, so what stays does not grow with the world
  // (4 bytes a holding, where every rank's Piece and holder list were ~240).
  struct Pieces {
    std::vector<uint32_t> ids;                    // each holding's holder-set id (SetId)
    std::vector<std::pair<uint32_t, Piece>> kept;  // (holding, its piece), ascending
    bool broadcast = false;                       // one piece, the whole entry, held by every rank
    const Piece& KeptPiece(uint32_t holding) const;
  };
  // Holdings whose holder-set ids are consecutive and whose pieces count alike: `holding` is the first
  // of them, with id `id`; each is `bytes` on the wire, cut into `segments` messages when large.
  struct Band {
    uint32_t id = 0, ids = 0, holding = 0;
    uint64_t bytes = 0, segments = 0;
  };
  struct Counted {  // an entry's pieces, banded (shared by entries of the same shape, layout and parts)
    const Pieces* pieces = nullptr;
    std::vector<Band> bands;
  };
  struct Group;  // schedule.cc: a run of holder-set ids within a batch
  const Pieces& PiecesOf(uint32_t entry);
  // Every holding of the entry's (layout, shape): the last ones PiecesOf computed, else again.
  const std::vector<Holding>& HoldingsOf(uint32_t entry, const Pieces& p);
  const Counted& CountedOf(uint32_t entry);
  uint32_t SetId(const std::vector<int>& holders);
  void FillBatch();
  void CountBatch(const std::vector<uint32_t>& batch, std::vector<Group>* groups);
  uint64_t CutGroup(const std::vector<uint32_t>& batch, uint32_t id, uint64_t seq);
  template <typename F>
  void Cut(uint32_t entry, const StridedRuns& r, F&& fn);
  template <typename F>
  void Chunks(uint32_t entry, uint32_t part, uint64_t within, uint64_t count, uint64_t runs, uint64_t stride,
              uint64_t local, uint64_t local_stride, F&& fn);
  void Push(Message&& m);

  const Manifest& m_;
  Interest interest_;
  int world_;
  uint64_t chunk_, coalesce_;
  uint32_t next_broadcast_ = 0, next_shard_ = 0;
  uint64_t seq_ = 0;
  std::deque<Message, HostStlAllocator<Message>> queue_;
  std::map<std::pair<uint32_t, std::vector<uint64_t>>, Pieces> pieces_;  // by (layout, shape)
  std::vector<Holding> holdings_;         // HoldingsOf's, of holdings_of_
  const Pieces* holdings_of_ = nullptr;
  // Holder sets by id: a single rank r is id r, a larger set W + (its order of first meeting). One shared
  // list per set, so messages of a group share it.
  std::map<std::vector<int>, uint32_t> set_ids_;
  std::vector<std::shared_ptr<const std::vector<int>>> sets_;
  std::vector<char> wanted_;  // by set id: Interest::pieces of it
  std::vector<const Pieces*> pieces_of_;  // by entry, filled as entries are first met
  std::map<std::vector<uint64_t>, Counted> counted_;  // by (pieces, target dtype, parts' sizes and rows)
  std::vector<const Counted*> counted_of_;            // by entry
  std::vector<uint64_t> part_starts_;  // of the entry being cut: element where each part begins
  uint32_t part_starts_of_ = UINT32_MAX;
};

// One walk of a schedule read by several cursors on any threads (a stream's engine, its staging ring's
// reader and the ring's read-ahead): each message is generated once, and dropped when every open cursor
// has passed it. Memory: the messages between the slowest open cursor and the fastest.
//
// Thread safety: Next and Close from any thread; one thread per cursor.
class ScheduleWalk {
 public:
  ScheduleWalk(std::unique_ptr<Schedule> schedule, int cursors);
  // The cursor's next message, or nullptr when the schedule is done.
  std::shared_ptr<const Message> Next(int cursor);
  // The cursor reads no more: it no longer holds messages in memory.
  void Close(int cursor);

 private:
  void Trim();  // REQUIRES: mu_ held

  std::mutex mu_;
  std::unique_ptr<Schedule> schedule_;
  std::deque<std::shared_ptr<const Message>> window_;
  uint64_t base_ = 0;         // the index of window_.front()
  std::vector<uint64_t> at_;  // by cursor: the index of its next message; UINT64_MAX when closed
  bool done_ = false;
};

}  // namespace shardcast
