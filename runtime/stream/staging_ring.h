// runtime/stream/staging_ring: the reader side of a stream. Reader threads of its own walk the schedule,
// read every message this rank reads into the next free slot of a K-slot ring (or each of its segments
// straight into the sink, when the route keeps the bytes here and nowhere else), and hand the slots
// out in schedule order.
//
//   schedule:   m0  m1  m2  m3  m4 ...          (only the messages `select` picks)
//   slots:     [s0][s1][s2][s3]                 message i goes to slot i % K; its reader waits until the
//                                               consumer freed message i - K, so memory is K x chunk
//   readers:    R threads claim messages in schedule order, each reads its whole message; with R > 1
//               several messages are read at once (R <= K), and the consumer still takes them in order
//   read-ahead:          |<-- readahead_bytes -->|   the kernel is asked to fetch these file ranges now
//
// The ring reads through a Source (source.h): checkpoint files for a load, with the one conversion
// hook and consumed pages released; this rank's shards for a save.
//
// Thread safety: Next and Free are called by one consumer thread. The source's Read and Prefetch, and
// `select` and `in_place`, are called from every reader thread at once when readers > 1. Failure: a
// reader's exception is rethrown by Next (the other readers stop); a message not read by Next's deadline
// is kIo naming the segment the slowest reader is in.
//
// A reader stuck in the source (a hung mount) is not joined forever: after stopping the readers, the
// destructor waits `abandon_after`, then leaves those inside a source call behind. They then touch only
// memory they share with nobody but the ring (its slots and buffers, and the source, which the ring and
// the readers own together, so a source left behind lives until its call returns) and end. Known gap: an
// in-place destination (RingOptions::in_place) must outlive that call; the caller's usually does not.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "runtime/stream/source.h"

namespace shardcast {

struct RingOptions {
  uint32_t slots = 4;
  uint32_t readers = 1;  // reader threads (at most `slots`; 0 counts as 1)
  // > 0: each slot's staging buffer is made this large (in 2 MiB pages where the kernel has them) before the
  // readers start, then page-locked (cudaHostRegister) on the caller's thread while they fill the first slots;
  // the constructor returns once every slot is locked. REQUIRES: the target's CUDA device current there
  // (load.cc's guard), so a copy to the device from a slot needs no bounce; unpinned by the destructor, on
  // the caller's thread too. Reader threads make no CUDA call. A larger message is staged in pageable memory
  // beside its slot. Where pinning is refused (a build without CUDA, no device, a memlock limit) the slots stay
  // pageable, still of this size (pinned() says which); a buffer that cannot be made at all fails the ring.
  uint64_t pin_bytes = 0;
  uint64_t readahead_bytes = 256ull << 20;
  std::function<bool(const Message&)> select;              // the messages this rank reads
  // Whether to read a message in place: fills `at` with each segment's destination and returns true, or
  // returns false (read into the slot's staging buffer). Called on the reader thread. A destination is
  // writable host memory: the reader commits its missing whole pages for writing (MADV_POPULATE_WRITE)
  // before it reads each segment there.
  std::function<bool(const Message&, std::vector<unsigned char*>* at)> in_place;
  // How long the destructor waits for a reader stuck in the source before leaving it behind. Default 10 s.
  std::chrono::milliseconds abandon_after{10000};
};

class StagingRing {
 public:
  struct Slot {
    Message msg;
    unsigned char* data = nullptr;   // staged: the message's target bytes, contiguous; in place: nullptr
    std::vector<unsigned char*> at;  // where each segment's target bytes are (in `data`, or in place)
    bool in_place = false;
    bool filled = false;
    uint64_t index = 0;             // among the messages this ring reads
  };

  // Reads along `walk` with its cursors `reader` and `ahead` (the read-ahead), which it closes when its
  // thread ends. REQUIRES: walk outlives the ring.
  StagingRing(ScheduleWalk& walk, int reader, int ahead, std::shared_ptr<SegmentSource> source, RingOptions options);
  // Reads along a walk of its own over the whole schedule of `m`.
  StagingRing(const Manifest& m, std::shared_ptr<SegmentSource> source, RingOptions options);
  ~StagingRing();
  StagingRing(const StagingRing&) = delete;
  StagingRing& operator=(const StagingRing&) = delete;

  // The next filled slot in schedule order, or nullptr when every selected message was handed out.
  // Throws kIo when it is not read by `deadline` (the default waits as long as the reader takes).
  Slot* Next(std::chrono::steady_clock::time_point deadline = std::chrono::steady_clock::time_point::max());
  void Free(Slot* slot);
  uint64_t bytes_read() const;  // source bytes; valid after the last Next
  bool pinned() const { return pinned_; }  // the slots' staging buffers are page-locked
  double pin_seconds() const { return pin_seconds_; }  // spent page-locking them (beside the first reads)
  uint32_t readers() const { return static_cast<uint32_t>(threads_.size()); }

 private:
  struct Core;       // staging_ring.cc: what the readers share with the consumer, owned by all
  struct Abandoned;  // thrown on a reader when a source call returns to a ring that is gone
  struct Stopped;    // thrown on a reader about to enter a source call once the ring stops
  void Run(const std::shared_ptr<Core>& core, uint32_t lane);
  void ReadAll(Core& core, uint32_t lane);
  std::shared_ptr<const Message> Claim(Core& core, uint32_t lane, uint64_t* index);
  template <typename F>
  void InSource(Core& core, uint32_t lane, uint64_t seq, const Segment& g, F&& call);
  void Start();
  void Pin(const std::vector<unsigned char*>& buffers);
  void Prefetch(Core& core, uint32_t lane, uint64_t horizon);

  std::unique_ptr<ScheduleWalk> own_walk_;
  ScheduleWalk* walk_;
  int reader_, ahead_;
  RingOptions o_;
  std::shared_ptr<Core> core_;
  bool pinned_ = false;
  double pin_seconds_ = 0;
  std::vector<std::thread> threads_;
};

}  // namespace shardcast
