#include "runtime/stream.h"

#include <ATen/ATen.h>
#include <ATen/ops/from_blob.h>
#include <xxhash.h>

#include <condition_variable>
#include <cstring>
#include <deque>
#include <exception>
#include <mutex>
#include <thread>

#include "allocators/error.h"
#include "allocators/lazy_zero.h"
#include "runtime/schedule.h"

namespace shardcast {
namespace {

// A lazily grown lazy-zero buffer (bounce, scratch, staging slot): commits only what is written.
class Buffer {
 public:
  ~Buffer() { LazyZeroFree(data_, size_); }
  unsigned char* Get(uint64_t bytes) {
    if (bytes > size_) {
      LazyZeroFree(data_, size_);
      data_ = static_cast<unsigned char*>(LazyZeroAllocate(bytes));
      size_ = bytes;
    }
    return data_;
  }

 private:
  unsigned char* data_ = nullptr;
  uint64_t size_ = 0;
};

// XXH3 of the bytes each rank stores for each entry, in stream order. Per column, an entry's
// segments are consecutive, so one open state per column suffices.
class Digests {
 public:
  Digests(size_t entries, int columns) : columns_(columns), values_(entries * columns, 0), open_(columns) {}
  ~Digests() {
    for (auto& o : open_) XXH3_freeState(o.state);
  }
  void Update(uint32_t entry, int col, const void* p, uint64_t n) {
    Open& o = open_[col];
    if (o.state == nullptr) o.state = XXH3_createState();
    if (o.entry != static_cast<int64_t>(entry)) {
      Close(col);
      XXH3_64bits_reset(o.state);
      o.entry = entry;
    }
    XXH3_64bits_update(o.state, p, n);
  }
  std::vector<uint64_t> Finish() {
    for (int c = 0; c < columns_; ++c) Close(c);
    return values_;
  }

 private:
  struct Open {
    int64_t entry = -1;
    XXH3_state_t* state = nullptr;
  };
  void Close(int col) {
    Open& o = open_[col];
    if (o.entry >= 0) values_[static_cast<size_t>(o.entry) * columns_ + col] = XXH3_64bits_digest(o.state);
    o.entry = -1;
  }
  int columns_;
  std::vector<uint64_t> values_;
  std::vector<Open> open_;
};

// The local side of a segment: a host pointer to fill in place, or a copy into the target.
class Local {
 public:
  explicit Local(StreamTargets& t) : t_(t) {}
  unsigned char* Direct(const Segment& s) {
    at::Tensor& x = t_.tensors[s.entry];
    if (!x.defined() || !x.device().is_cpu()) return nullptr;
    return static_cast<unsigned char*>(x.data_ptr()) + s.local_offset;
  }
  unsigned char* DirectDevice(const Segment& s) {
    at::Tensor& x = t_.tensors[s.entry];
    if (!x.defined() || !x.device().is_cuda()) return nullptr;
    return static_cast<unsigned char*>(x.data_ptr()) + s.local_offset;
  }
  at::Tensor DeviceBytes(const Segment& s) {
    return t_.tensors[s.entry].view({-1}).view(at::kByte).narrow(0, static_cast<int64_t>(s.local_offset),
                                                                  static_cast<int64_t>(s.target_bytes));
  }
  // Returns true when the bytes were stored (false: the checksum-only sink).
  bool Store(const Segment& s, const unsigned char* data) {
    at::Tensor& x = t_.tensors[s.entry];
    if (!x.defined()) return false;
    if (x.device().is_cpu()) {
      std::memcpy(static_cast<unsigned char*>(x.data_ptr()) + s.local_offset, data, s.target_bytes);
    } else {
      at::Tensor src = at::from_blob(const_cast<unsigned char*>(data), {static_cast<int64_t>(s.target_bytes)}, at::kByte);
      x.view({-1}).view(at::kByte).narrow(0, static_cast<int64_t>(s.local_offset), static_cast<int64_t>(s.target_bytes))
          .copy_(src);
    }
    return true;
  }

 private:
  StreamTargets& t_;
};

// Device buffers for a communicator that sends from device memory (NCCL): one reusable byte tensor
// per use, grown as needed, on the current CUDA device.
class DeviceBuffer {
 public:
  unsigned char* Get(uint64_t bytes) {
    if (!t_.defined() || static_cast<uint64_t>(t_.numel()) < bytes) {
      t_ = at::empty({static_cast<int64_t>(std::max<uint64_t>(bytes, 1))}, at::TensorOptions().dtype(at::kByte).device(at::kCUDA));
    }
    return t_.data_ptr<unsigned char>();
  }
  void FromHost(const unsigned char* host, uint64_t bytes) {
    Get(bytes);
    t_.narrow(0, 0, static_cast<int64_t>(bytes)).copy_(HostBytes(host, bytes));
  }
  void ToHost(unsigned char* host, uint64_t bytes) const {
    HostBytes(host, bytes).copy_(t_.narrow(0, 0, static_cast<int64_t>(bytes)));
  }
  static at::Tensor HostBytes(const unsigned char* p, uint64_t n) {
    return at::from_blob(const_cast<unsigned char*>(p), {static_cast<int64_t>(n)}, at::kByte);
  }

 private:
  at::Tensor t_;
};

constexpr uint64_t kReleaseStep = 8ull << 20;

// Reads a segment's source bytes and writes its target bytes (converted if the dtypes differ).
void ReadSegment(const Manifest& m, const Checkpoint& ckpt, const Segment& s, unsigned char* out, Buffer* scratch,
                 bool release) {
  const ManifestEntry& e = m.entries[s.entry];
  const ManifestPart& p = e.parts[s.part];
  const SafetensorsFile& f = ckpt.file(p.file);
  const std::string what = "tensor '" + p.checkpoint_key + "'";
  // In steps of kReleaseStep, each released as soon as it is copied: file pages mapped at once stay a
  // few MiB, not a whole 64 MiB chunk.
  const uint64_t ss = DTypeSize(p.source_dtype), ts = DTypeSize(e.target_dtype);
  const uint64_t step = std::max<uint64_t>(ss, kReleaseStep / ss * ss);
  for (uint64_t done = 0; done < s.source_bytes; done += step) {
    const uint64_t n = std::min(step, s.source_bytes - done);
    unsigned char* dst = out + done / ss * ts;
    if (p.source_dtype == e.target_dtype) {
      f.ReadBytes(s.source_offset + done, n, dst, what);
    } else {
      unsigned char* raw = scratch->Get(n);
      f.ReadBytes(s.source_offset + done, n, raw, what);
      ConvertElements(p.source_dtype, e.target_dtype, raw, dst, n / ss);
    }
    if (release) f.ReleasePages(s.source_offset + done, n);
  }
}

// The reader side of the staging ring: K slots, filled in schedule order by a thread of its own.
class StagingRing {
 public:
  StagingRing(const Manifest& m, const Checkpoint& ckpt, const LoadOptions& o, int world)
      : m_(m), ckpt_(ckpt), o_(o), slots_(o.staging_slots), buffers_(o.staging_slots),
        schedule_(m, world, o.chunk_bytes) {
    thread_ = std::thread([this] { Run(); });
  }
  ~StagingRing() {
    {
      std::lock_guard<std::mutex> l(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }
  // The next filled slot (in schedule order), or nullptr when the schedule is done. Rethrows the
  // reader's error.
  struct Slot {
    Message msg;
    unsigned char* data = nullptr;
    bool filled = false;
    uint64_t seq = 0;
  };
  Slot* Next() {
    std::unique_lock<std::mutex> l(mu_);
    Slot& s = slots_[taken_ % slots_.size()];
    cv_.wait(l, [&] { return error_ || (s.filled && s.seq == taken_) || (done_ && filled_ == taken_); });
    if (error_) std::rethrow_exception(error_);
    if (!(s.filled && s.seq == taken_)) return nullptr;
    ++taken_;
    return &s;
  }
  void Free(Slot* s) {
    {
      std::lock_guard<std::mutex> l(mu_);
      s->filled = false;
    }
    cv_.notify_all();
  }

 private:
  void Run() {
    try {
      Buffer scratch;
      Message msg;
      for (uint64_t seq = 0; schedule_.Next(&msg); ++seq) {
        Slot& s = slots_[seq % slots_.size()];
        {
          std::unique_lock<std::mutex> l(mu_);
          cv_.wait(l, [&] { return stop_ || !s.filled; });
          if (stop_) return;
        }
        unsigned char* data = buffers_[seq % slots_.size()].Get(std::max<uint64_t>(msg.target_bytes, 1));
        uint64_t off = 0;
        for (const Segment& seg : msg.segments) {
          ReadSegment(m_, ckpt_, seg, data + off, &scratch, o_.release_pages);
          off += seg.target_bytes;
        }
        {
          std::lock_guard<std::mutex> l(mu_);
          s.msg = std::move(msg);
          s.data = data;
          s.seq = seq;
          s.filled = true;
          filled_ = seq + 1;
        }
        cv_.notify_all();
      }
      std::lock_guard<std::mutex> l(mu_);
      done_ = true;
    } catch (...) {
      std::lock_guard<std::mutex> l(mu_);
      error_ = std::current_exception();
    }
    cv_.notify_all();
  }

  const Manifest& m_;
  const Checkpoint& ckpt_;
  const LoadOptions& o_;
  std::vector<Slot> slots_;
  std::vector<Buffer> buffers_;  // owned here, not by the reader: sends read them after it finishes
  Schedule schedule_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false, done_ = false;
  uint64_t taken_ = 0, filled_ = 0;
  std::exception_ptr error_;
  std::thread thread_;
};

StreamStats Receive(Communicator& comm, const Manifest& m, StreamTargets& targets, const LoadOptions& o,
                    bool want_digests) {
  StreamStats st;
  Local local(targets);
  Digests digests(m.entries.size(), 1);
  Buffer bounce, host_copy;
  DeviceBuffer device_bounce;
  const bool on_device = comm.device_buffers();
  Schedule schedule(m, comm.world_size(), o.chunk_bytes);
  Message msg;
  const int me = comm.rank();
  while (schedule.Next(&msg)) {
    if (msg.dest != me && msg.dest != kBroadcast) continue;
    // In place when the message is one segment and its destination lives where the transport writes.
    unsigned char* direct = nullptr;
    if (msg.direct()) direct = on_device ? local.DirectDevice(msg.segments[0]) : local.Direct(msg.segments[0]);
    unsigned char* buf = direct ? direct : on_device ? device_bounce.Get(msg.target_bytes) : bounce.Get(msg.target_bytes);
    if (msg.dest == kBroadcast) {
      comm.Broadcast(buf, msg.target_bytes, 0);
    } else {
      comm.Recv(buf, msg.target_bytes, 0);
    }
    st.bytes_received += msg.target_bytes;
    // Host bytes for storing and hashing: the buffer itself, or a copy off the device.
    const unsigned char* host = buf;
    if (on_device && (!direct || want_digests)) {
      unsigned char* h = host_copy.Get(msg.target_bytes);
      if (direct) {
        DeviceBuffer::HostBytes(h, msg.target_bytes).copy_(local.DeviceBytes(msg.segments[0]));
      } else {
        device_bounce.ToHost(h, msg.target_bytes);
      }
      host = h;
    }
    uint64_t off = 0;
    for (const Segment& s : msg.segments) {
      const unsigned char* p = host + off;
      if (direct || local.Store(s, p)) st.bytes_stored += s.target_bytes;
      if (want_digests) digests.Update(s.entry, 0, p, s.target_bytes);
      off += s.target_bytes;
    }
  }
  st.digests = digests.Finish();
  return st;
}

}  // namespace

uint64_t TotalTargetBytes(const Manifest& m, int world_size) {
  uint64_t total = 0;
  for (const auto& e : m.entries) {
    uint64_t n = DTypeSize(e.target_dtype);
    for (uint64_t d : e.shape) n *= d;
    total += n;
  }
  return total;
}

StreamStats StreamRank0(Communicator& comm, const Manifest& m, const Checkpoint* ckpt, StreamTargets& targets,
                        const LoadOptions& o, const Progress& progress) {
  const bool want_digests = o.verify;
  if (comm.rank() != 0) return Receive(comm, m, targets, o, want_digests);
  const int world = comm.world_size();
  StreamStats st;
  Local local(targets);
  Digests digests(m.entries.size(), world);
  const uint64_t total = TotalTargetBytes(m, world);
  uint64_t done = 0;
  StagingRing ring(m, *ckpt, o, world);
  const bool on_device = comm.device_buffers();
  std::vector<DeviceBuffer> device_slots(on_device ? o.staging_slots : 0);
  struct InFlight {
    StagingRing::Slot* slot;
    uint64_t seq;
    std::unique_ptr<PendingSend> send;
  };
  std::deque<InFlight> inflight;
  const size_t max_inflight = std::max(1, o.staging_slots - 1);
  const uint64_t slots = static_cast<uint64_t>(o.staging_slots);
  auto retire_oldest = [&] {
    inflight.front().send->Wait();
    ring.Free(inflight.front().slot);
    inflight.pop_front();
  };
  // Message n goes into slot n % K: the send still holding that slot (message n - K) must finish
  // first, or the reader waits for the slot while we wait for the reader.
  for (uint64_t seq = 0;; ++seq) {
    while (!inflight.empty() && inflight.front().seq + slots <= seq) retire_oldest();
    StagingRing::Slot* slot = ring.Next();
    if (slot == nullptr) break;
    const Message& msg = slot->msg;
    st.bytes_read += msg.target_bytes;
    uint64_t off = 0;
    for (const Segment& s : msg.segments) {  // what each destination will hold, hashed as sent
      if (msg.dest == 0 || msg.dest == kBroadcast) {
        if (local.Store(s, slot->data + off)) st.bytes_stored += s.target_bytes;
      }
      if (want_digests) {
        for (int c = 0; c < world; ++c) {
          if (msg.dest == c || msg.dest == kBroadcast) digests.Update(s.entry, c, slot->data + off, s.target_bytes);
        }
      }
      off += s.target_bytes;
    }
    // A device transport sends from a device copy of the slot.
    unsigned char* wire = slot->data;
    if (on_device && msg.dest != 0) {
      DeviceBuffer& d = device_slots[seq % device_slots.size()];
      d.FromHost(slot->data, msg.target_bytes);
      wire = d.Get(msg.target_bytes);
    }
    if (msg.dest == kBroadcast) {
      comm.Broadcast(wire, msg.target_bytes, 0);
      st.bytes_sent += msg.target_bytes * static_cast<uint64_t>(world - 1);
      ring.Free(slot);
    } else if (msg.dest == 0) {
      ring.Free(slot);
    } else {
      inflight.push_back({slot, seq, comm.SendAsync(wire, msg.target_bytes, msg.dest)});
      st.bytes_sent += msg.target_bytes;
      if (inflight.size() >= max_inflight) retire_oldest();
    }
    done += msg.target_bytes;
    if (progress) progress(done, total);
  }
  while (!inflight.empty()) retire_oldest();
  st.digests = digests.Finish();
  return st;
}

StreamStats StreamEachRank(Communicator& comm, const Manifest& m, const Checkpoint& ckpt, StreamTargets& targets,
                           const LoadOptions& o) {
  StreamStats st;
  Local local(targets);
  const int me = comm.rank(), world = comm.world_size();
  // With --verify, rank 0 also derives every rank's expected digests from its own view of the files.
  const bool expect_all = o.verify && me == 0;
  Digests digests(m.entries.size(), expect_all ? world : 1);
  Buffer bounce, scratch;
  Schedule schedule(m, world, o.chunk_bytes);
  Message msg;
  while (schedule.Next(&msg)) {
    const bool mine = msg.dest == me || msg.dest == kBroadcast;
    if (!mine && !expect_all) continue;
    for (const Segment& s : msg.segments) {
      unsigned char* direct = mine ? local.Direct(s) : nullptr;
      unsigned char* out = direct ? direct : bounce.Get(s.target_bytes);
      ReadSegment(m, ckpt, s, out, &scratch, o.release_pages && mine);
      st.bytes_read += s.source_bytes;
      if (mine && (direct || local.Store(s, out))) st.bytes_stored += s.target_bytes;
      if (o.verify) {
        for (int c = 0; c < (expect_all ? world : 1); ++c) {
          int rank = expect_all ? c : me;
          if (msg.dest == rank || msg.dest == kBroadcast) digests.Update(s.entry, c, out, s.target_bytes);
        }
      }
    }
  }
  st.digests = digests.Finish();
  return st;
}

}  // namespace shardcast
