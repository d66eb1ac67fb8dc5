// runtime/staging_ring: the reader side of a stream. A thread of its own walks the schedule, reads
// every message this rank reads into the next free slot of a K-slot ring (or each of its segments
// straight into the sink, when the route keeps the bytes here and nowhere else), and hands the slots
// out in schedule order.
//
//   schedule:   m0  m1  m2  m3  m4 ...          (only the messages `select` picks)
//   slots:     [s0][s1][s2][s3]                 message i goes to slot i % K; the reader waits for a
//                                               slot its consumer has freed, so memory is K x chunk
//   read-ahead:          |<-- readahead_bytes -->|   the kernel is asked to fetch these file ranges now
//
// The ring reads through a Source (source.h): checkpoint files for a load, with the one conversion
// hook and consumed pages released; this rank's shards for a save.
//
// Thread safety: Next and Free are called by one consumer thread. Failure: the reader's exception
// is rethrown by Next.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#include "runtime/source.h"

namespace shardcast {

struct RingOptions {
  uint32_t slots = 4;
  uint64_t readahead_bytes = 256ull << 20;
  std::function<bool(const Message&)> select;              // the messages this rank reads
  // Whether to read a message in place: fills `at` with each segment's destination and returns true,
  // or returns false (read into the slot's staging buffer). Called on the reader thread.
  std::function<bool(const Message&, std::vector<unsigned char*>* at)> in_place;
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
  StagingRing(ScheduleWalk& walk, int reader, int ahead, SegmentSource& source, RingOptions options);
  // Reads along a walk of its own over the whole schedule of `m`.
  StagingRing(const Manifest& m, SegmentSource& source, RingOptions options);
  ~StagingRing();
  StagingRing(const StagingRing&) = delete;
  StagingRing& operator=(const StagingRing&) = delete;

  // The next filled slot in schedule order, or nullptr when every selected message was handed out.
  Slot* Next();
  void Free(Slot* slot);
  uint64_t bytes_read() const { return bytes_read_; }  // source bytes; valid after the last Next

 private:
  void Run();
  void Start();
  void Prefetch(std::shared_ptr<const Message>* pending, uint64_t horizon);

  std::unique_ptr<ScheduleWalk> own_walk_;
  ScheduleWalk* walk_;
  int reader_, ahead_;
  SegmentSource& source_;
  RingOptions o_;
  std::vector<Slot> slots_;
  std::vector<Buffer> buffers_;  // owned here: sends read them after the reader is done
  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false, done_ = false;
  uint64_t taken_ = 0, filled_ = 0, prefetched_ = 0, bytes_read_ = 0;
  std::exception_ptr error_;
  std::thread thread_;
};

}  // namespace shardcast
