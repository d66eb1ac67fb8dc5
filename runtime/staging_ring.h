// runtime/staging_ring: the reader side of a stream. A thread of its own walks the schedule, reads
// every message this rank reads into the next free slot of a K-slot ring (or straight into the
// sink, when the route keeps the bytes here), and hands the slots out in schedule order.
//
//   schedule:   m0  m1  m2  m3  m4 ...          (only the messages `select` picks)
//   slots:     [s0][s1][s2][s3]                 message i goes to slot i % K; the reader waits for a
//                                               slot its consumer has freed, so memory is K x chunk
//   read-ahead:          |<-- readahead_bytes -->|   the kernel is asked to fetch these file ranges now
//
// PartReader is the one conversion hook: it sees the part, the element (row) range and writes the
// target bytes; dtype conversion happens there (and fp8 dequantization will). Consumed file pages
// are released in 8 MiB steps, so RssFile stays flat.
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

#include "loaders/safetensors_file.h"
#include "runtime/schedule.h"

namespace shardcast {

// The manifest's files as this rank opened them, by manifest file index (agreed by name, size and
// header digest in the handshake).
using FileTable = std::vector<const SafetensorsFile*>;

// A lazily grown lazy-zero buffer: commits only what is written.
class Buffer {
 public:
  Buffer() = default;
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  ~Buffer();
  unsigned char* Get(uint64_t bytes);

 private:
  unsigned char* data_ = nullptr;
  uint64_t size_ = 0;
};

class PartReader {
 public:
  PartReader(const Manifest& m, const FileTable& files, bool release_pages)
      : m_(m), files_(files), release_(release_pages) {}
  // Writes segment s's target bytes at `out`. Throws kCheckpoint for a truncated or changed file.
  void Read(const Segment& s, unsigned char* out);

 private:
  const Manifest& m_;
  const FileTable& files_;
  bool release_;
  Buffer scratch_;
};

struct RingOptions {
  uint32_t slots = 4;
  bool release_pages = true;
  uint64_t readahead_bytes = 256ull << 20;
  std::function<bool(const Message&)> select;              // the messages this rank reads
  std::function<unsigned char*(const Message&)> in_place;  // where to read one in place, or nullptr
};

class StagingRing {
 public:
  struct Slot {
    Message msg;
    unsigned char* data = nullptr;  // the message's target bytes (a staging buffer, or the sink)
    bool in_place = false;
    bool filled = false;
    uint64_t index = 0;             // among the messages this ring reads
  };

  StagingRing(const Manifest& m, const FileTable& files, RingOptions options);
  ~StagingRing();
  StagingRing(const StagingRing&) = delete;
  StagingRing& operator=(const StagingRing&) = delete;

  // The next filled slot in schedule order, or nullptr when every selected message was handed out.
  Slot* Next();
  void Free(Slot* slot);
  uint64_t bytes_read() const { return bytes_read_; }  // source bytes; valid after the last Next

 private:
  void Run();
  void Prefetch(Schedule* ahead, Message* pending, uint64_t horizon);

  const Manifest& m_;
  const FileTable& files_;
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
