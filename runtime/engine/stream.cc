#include "runtime/engine/stream.h"

#include <ATen/ATen.h>
#include <ATen/ops/from_blob.h>

#include <algorithm>
#include <deque>
#include <functional>
#include <optional>
#include <set>

#include "allocators/error.h"
#include "allocators/scratch_buffer.h"
#include "runtime/agree/failure.h"
#include "runtime/agree/fault.h"
#include "runtime/agree/verdict.h"

namespace shardcast {
namespace {

// This rank's part of the schedule walked with no I/O: `visit(msg, task)` for each message the route gives
// it a part in, until `visit` returns false.
void WalkTasks(const Manifest& m, const Route& route, int me, bool verify,
               const std::function<bool(const Message&, const Task&)>& visit) {
  Schedule schedule(m, route.InterestOf(me, verify));
  Message msg;
  while (schedule.Next(&msg)) {
    const Task t = route.For(msg, me, verify);
    if (t.any() && !visit(msg, t)) return;
  }
}

// Memory a device transport (NCCL) moves bytes through: one reusable byte tensor per use, grown as needed.
class DeviceBuffer {
 public:
  unsigned char* Get(uint64_t bytes) {
    if (!t_.defined() || static_cast<uint64_t>(t_.numel()) < bytes) {
      t_ = at::empty({static_cast<int64_t>(std::max<uint64_t>(bytes, 1))},
                     at::TensorOptions().dtype(at::kByte).device(at::kCUDA));
    }
    return t_.data_ptr<unsigned char>();
  }
  unsigned char* FromHost(const unsigned char* host, uint64_t bytes) {
    unsigned char* d = Get(bytes);
    t_.narrow(0, 0, static_cast<int64_t>(bytes)).copy_(HostBytes(host, bytes));
    return d;
  }
  void ToHost(unsigned char* host, uint64_t bytes) const {
    HostBytes(host, bytes).copy_(t_.narrow(0, 0, static_cast<int64_t>(bytes)));
  }

 private:
  static at::Tensor HostBytes(const unsigned char* p, uint64_t n) {
    return at::from_blob(const_cast<unsigned char*>(p), {static_cast<int64_t>(n)}, at::kByte);
  }
  at::Tensor t_;
};

// K buffers used round-robin, each busy until the sends from it complete: message i uses buffer i % K,
// so the sends from message i - K must be done first. Retiring oldest-first keeps memory at K buffers.
struct SendSlots {
  struct InFlight {
    uint64_t index;
    StagingRing::Slot* ring_slot;  // the reader's staging slot to free, or nullptr
    std::vector<std::unique_ptr<PendingSend>> sends;
  };
  std::deque<InFlight> inflight;
  uint64_t next = 0;
};

class Engine {
 public:
  explicit Engine(const StreamContext& c)
      : c_(c), comm_(*c.comm), m_(*c.manifest), route_(*c.route), me_(comm_.rank()), world_(comm_.world_size()),
        verify_(m_.params.verify), on_device_(comm_.device_buffers()), slots_(m_.params.staging_slots),
        device_slots_(on_device_ ? slots_ : 0), forward_host_(slots_), forward_device_(on_device_ ? slots_ : 0) {
    r_.held = DigestColumn(verify_ ? m_.entries.size() : 0);
    r_.expected = ExpectedDigests(m_.entries.size());
  }

  StreamResult Run() {
    try {
      return RunLoop();
    } catch (...) {
      // Sends still in flight point into the staging ring and the forward buffers, which unwinding is
      // about to free. Abort first (peers blocked on us fail at once and learn the cause from the failure
      // the caller publishes), then release every pending send while its bytes are still mapped: that,
      // not the abort, is what ends the transport's use of them (communicator.h, PendingSend). Gloo's
      // abort does not cancel a send whose receiver has not posted its receive yet; destroying the send
      // does, and waits out a write in progress.
      if (!reading_.inflight.empty() || !forwarding_.inflight.empty()) {
        comm_.Abort();
        ReleaseSends();
      }
      throw;
    }
  }

 private:
  // One walk of this rank's part of the schedule, read by this loop and by the ring's reader and
  // read-ahead (cursors kEngine, kReader, kAhead).
  enum Cursor { kEngine = 0, kReader = 1, kAhead = 2 };

  StreamResult RunLoop() {
    const uint64_t total = c_.progress ? [&] {
      const StreamStats plan = PlanStream(c_);
      return plan.bytes_read + plan.bytes_received;
    }() : 0;
    const bool reads = route_.Reads(me_, verify_);
    walk_.emplace(std::make_unique<Schedule>(m_, route_.InterestOf(me_, verify_)), reads ? 3 : 1);
    if (reads) {
      ring_.emplace(*walk_, kReader, kAhead, c_.source, RingFor());
      r_.stats.read_threads = ring_->readers();
      r_.stats.pinned_staging = ring_->pinned() ? pin_bytes_ * slots_ : 0;
      r_.stats.pin_seconds = ring_->pin_seconds();
    }
    std::set<int> verifiers;
    uint64_t done = 0;
    while (const std::shared_ptr<const Message> next = walk_->Next(kEngine)) {
      const Message& msg = *next;
      const Task t = route_.For(msg, me_, verify_);
      if (!t.any()) continue;
      FaultPoint("stream", me_);
      if (t.read) {
        FromRing(msg, t);
      } else {
        FromWire(msg, t);
      }
      if (verify_ && t.keep) verifiers.insert(route_.VerifierOf(msg, me_));
      ++r_.stats.messages;
      done += msg.target_bytes;
      if (c_.progress) c_.progress(done, total);
    }
    while (!reading_.inflight.empty()) Retire(&reading_);
    while (!forwarding_.inflight.empty()) Retire(&forwarding_);
    if (ring_) r_.stats.bytes_read = ring_->bytes_read();
    r_.verifiers.assign(verifiers.begin(), verifiers.end());
    return std::move(r_);
  }

  RingOptions RingFor() {
    RingOptions o;
    o.slots = slots_;
    o.readahead_bytes = c_.readahead_bytes;
    o.readers = c_.read_threads;
    pin_bytes_ = c_.pin_staging ? LargestRead() : 0;
    o.pin_bytes = pin_bytes_;
    o.select = [this](const Message& msg) { return route_.For(msg, me_, verify_).read; };
    // In place: bytes kept here and sent nowhere, each segment read straight into its shard (no
    // staging copy: a batch of small expert matrices lands as it is read). A broadcast needs the
    // message contiguous on the host: one direct segment only.
    o.in_place = [this](const Message& msg, std::vector<unsigned char*>* at) {
      const Task t = route_.For(msg, me_, verify_);
      if (!t.keep || !t.send_to.empty() || (t.broadcast && (on_device_ || !msg.direct()))) return false;
      at->clear();
      for (const Segment& s : msg.segments) {
        unsigned char* p = c_.sink->HostDirect(s);
        if (p == nullptr) return false;
        at->push_back(p);
      }
      return true;
    };
    return o;
  }

  // What each staging slot needs page-locked: the largest message this rank reads, at most one chunk (a
  // larger one is staged in pageable memory beside the slot). A load of a few small tensors (a round of a
  // training state) then locks kilobytes, not slots x chunk. Messages rarely fill a chunk exactly (whole
  // rows), so the walk stops once the reads seen fill the ring, or after a few thousand messages: a load
  // that large gets whole chunks, as before, at the cost of a short look ahead.
  uint64_t LargestRead() const {
    const uint64_t chunk = m_.params.chunk_bytes;
    constexpr int kMostMessages = 4096;
    uint64_t most = 0, seen = 0;
    int n = 0;
    bool whole_chunks = false;
    WalkTasks(m_, route_, me_, verify_, [&](const Message& msg, const Task& t) {
      if (most >= chunk || seen >= chunk * slots_ || n++ >= kMostMessages) {
        whole_chunks = true;
        return false;
      }
      if (t.read) {
        most = std::max(most, msg.target_bytes);
        seen += msg.target_bytes;
      }
      return true;
    });
    return whole_chunks ? chunk : std::min(most, chunk);
  }

  // Drops every pending send without waiting for it (the failure path). REQUIRES: the buffers they
  // read from are still alive.
  void ReleaseSends() {
    reading_.inflight.clear();
    forwarding_.inflight.clear();
  }

  void Retire(SendSlots* s) {
    for (auto& send : s->inflight.front().sends) send->Wait();
    if (s->inflight.front().ring_slot != nullptr) ring_->Free(s->inflight.front().ring_slot);
    s->inflight.pop_front();
  }
  // Before message `index` takes buffer index % K: the sends still using it must finish.
  void MakeRoom(SendSlots* s) {
    while (!s->inflight.empty() && s->inflight.front().index + slots_ <= s->next) Retire(s);
  }
  void Send(SendSlots* s, uint64_t index, StagingRing::Slot* ring_slot, const unsigned char* wire, uint64_t n,
            const std::vector<int>& to) {
    SendSlots::InFlight f{index, ring_slot, {}};
    for (int peer : to) f.sends.push_back(comm_.SendAsync(wire, n, peer));
    r_.stats.bytes_sent += n * to.size();
    s->inflight.push_back(std::move(f));
    if (s->inflight.size() >= std::max<size_t>(1, slots_ - 1)) Retire(s);
  }

  // A reader stuck in storage (a hung mount) fails this rank within the communicator's timeout; a
  // communicator without one (a world of one) waits as long as the read takes.
  std::chrono::steady_clock::time_point ReadDeadline() const {
    const std::chrono::milliseconds timeout = comm_.timeout();
    if (timeout.count() <= 0) return std::chrono::steady_clock::time_point::max();
    return std::chrono::steady_clock::now() + timeout;
  }

  // This rank read `msg`: hash it, broadcast it, keep it, send it.
  void FromRing(const Message& msg, const Task& t) {
    MakeRoom(&reading_);  // or the reader waits for a slot while we wait for the reader
    StagingRing::Slot* slot = ring_->Next(ReadDeadline());
    if (slot == nullptr || slot->msg.seq != msg.seq) {
      throw Error(ErrorKind::kInternal, "stream", "the staging ring fell out of step with the schedule");
    }
    const uint64_t index = reading_.next++, n = msg.target_bytes;
    Expect(msg, slot->at, t.verify_for);
    // A broadcast or a send has the message contiguous: staged, or one segment in place.
    unsigned char* data = slot->in_place ? slot->at[0] : slot->data;
    const bool device_copy = on_device_ && (t.broadcast || !t.send_to.empty());
    unsigned char* wire = device_copy ? device_slots_[index % slots_].FromHost(data, n) : data;
    if (t.broadcast) {
      comm_.Broadcast(wire, n, me_);
      r_.stats.bytes_sent += n * static_cast<uint64_t>(world_ - 1);
    }
    if (t.keep) Keep(msg, slot->at, slot->in_place);
    if (t.send_to.empty()) {
      ring_->Free(slot);
    } else {
      Send(&reading_, index, slot, wire, n, t.send_to);
    }
  }

  // This rank receives `msg` (and forwards it to `send_to`, the next replicas of a chain).
  void FromWire(const Message& msg, const Task& t) {
    const uint64_t n = msg.target_bytes;
    const Segment& first = msg.segments[0];
    const bool forward = !t.send_to.empty();
    unsigned char* direct = nullptr;
    if (msg.direct() && !forward) direct = on_device_ ? c_.sink->DeviceDirect(first) : c_.sink->HostDirect(first);
    uint64_t index = 0;
    unsigned char* buf = direct;
    if (forward) {
      MakeRoom(&forwarding_);
      index = forwarding_.next++;
      buf = on_device_ ? forward_device_[index % slots_].Get(n) : forward_host_[index % slots_].Get(n);
    } else if (buf == nullptr) {
      buf = on_device_ ? device_bounce_.Get(n) : bounce_.Get(n);
    }
    if (t.broadcast) {
      comm_.Broadcast(buf, n, t.peer);
    } else {
      comm_.Recv(buf, n, t.peer);
    }
    r_.stats.bytes_received += n;
    const unsigned char* host = buf;
    if (on_device_ && !direct) {  // device bytes to the host, for the sink and the digests
      if (forward) {
        HostBytes(bounce_.Get(n), n).copy_(HostBytes(buf, n, at::kCUDA));
      } else {
        device_bounce_.ToHost(bounce_.Get(n), n);
      }
      host = bounce_.Get(n);
    } else if (on_device_ && verify_) {
      c_.sink->CopyDeviceToHost(first, bounce_.Get(n));
      host = bounce_.Get(n);
    }
    if (t.keep) Keep(msg, Spread(msg, host), direct != nullptr);
    if (forward) Send(&forwarding_, index, nullptr, buf, n, t.send_to);
  }

  static at::Tensor HostBytes(const unsigned char* p, uint64_t n, at::DeviceType device = at::kCPU) {
    return at::from_blob(const_cast<unsigned char*>(p), {static_cast<int64_t>(n)},
                         at::TensorOptions().dtype(at::kByte).device(device));
  }

  // Where each segment of a contiguous message is.
  static std::vector<unsigned char*> Spread(const Message& msg, const unsigned char* data) {
    std::vector<unsigned char*> at;
    at.reserve(msg.segments.size());
    for (const Segment& s : msg.segments) {
      at.push_back(const_cast<unsigned char*>(data));
      data += s.target_bytes;
    }
    return at;
  }

  // `at`: each segment's target bytes (in place: already in the sink).
  void Keep(const Message& msg, const std::vector<unsigned char*>& at, bool in_place) {
    for (size_t i = 0; i < msg.segments.size(); ++i) {
      const Segment& s = msg.segments[i];
      if (!in_place) c_.sink->Store(s, at[i]);
      if (c_.sink->keeps()) r_.stats.bytes_stored += s.target_bytes;
      if (verify_) r_.held.Add(s.entry, SegmentDigest(at[i], s.target_bytes, s.local_offset));
    }
  }

  void Expect(const Message& msg, const std::vector<unsigned char*>& at, const std::vector<int>& ranks) {
    if (ranks.empty()) return;
    for (size_t i = 0; i < msg.segments.size(); ++i) {
      const Segment& s = msg.segments[i];
      const uint64_t d = SegmentDigest(at[i], s.target_bytes, s.local_offset);
      for (int r : ranks) r_.expected.Add(r, s.entry, d);
    }
  }

  const StreamContext& c_;
  Communicator& comm_;
  const Manifest& m_;
  const Route& route_;
  const int me_, world_;
  const bool verify_, on_device_;
  const uint32_t slots_;
  uint64_t pin_bytes_ = 0;  // page-locked per staging slot (a CUDA target)
  std::optional<ScheduleWalk> walk_;  // before ring_: the ring's thread reads it until the ring is gone
  std::optional<StagingRing> ring_;
  std::vector<DeviceBuffer> device_slots_;  // device copies of staging slots (device transports)
  std::vector<ScratchBuffer> forward_host_;  // received messages this rank forwards
  std::vector<DeviceBuffer> forward_device_;
  DeviceBuffer device_bounce_;
  ScratchBuffer bounce_;
  // After every buffer a send may read from, so that even a path that skips Run's catch destroys the
  // pending sends (members are destroyed in reverse order) before those buffers.
  SendSlots reading_, forwarding_;
  StreamResult r_;
};

}  // namespace

uint64_t TotalTargetBytes(const Manifest& m) {
  uint64_t total = 0;
  for (const auto& e : m.entries) {
    uint64_t n = DTypeSize(e.target_dtype);
    for (uint64_t d : e.shape) n *= d;
    total += n;
  }
  return total;
}

StreamStats PlanStream(const StreamContext& c) {
  StreamStats st;
  WalkTasks(*c.manifest, *c.route, c.comm->rank(), c.manifest->params.verify, [&](const Message& msg, const Task& t) {
    ++st.messages;
    if (t.read) st.bytes_read += msg.target_bytes;
    if (t.receive || (t.broadcast && !t.read)) st.bytes_received += msg.target_bytes;
    return true;
  });
  return st;
}

StreamResult RunStream(const StreamContext& c) { return Engine(c).Run(); }

StreamResult StreamTogether(Communicator& comm, const StreamContext& c, const char* operation,
                            const char* verdict_phase, bool name_rank) {
  const bool wire = c.route->Communicates();
  Problem local;
  std::optional<StreamResult> r;
  try {
    r = RunStream(c);
    if (wire) comm.Barrier();
  } catch (const std::exception& e) {
    if (wire) FailTogether(comm, e, operation);
    local = AsProblem(e);
    if (name_rank) local.message = "rank " + std::to_string(comm.rank()) + ": " + local.message;
  }
  if (!wire) {
    Together(
        comm,
        [&] {
          Agree(comm, verdict_phase, local);
          return 0;
        },
        operation);
  }
  return std::move(*r);
}

}  // namespace shardcast
