#include "runtime/stream.h"

#include <ATen/ATen.h>
#include <ATen/ops/from_blob.h>

#include <deque>
#include <optional>

#include "allocators/error.h"
#include "runtime/fault.h"

namespace shardcast {
namespace {

// The transport's memory: host for Gloo; for a device transport (NCCL), device buffers that host
// bytes are copied through. One reusable byte tensor per use, grown as needed.
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

class Engine {
 public:
  explicit Engine(const StreamContext& c)
      : c_(c), comm_(*c.comm), m_(*c.manifest), route_(*c.route), me_(comm_.rank()),
        verify_(m_.params.verify), on_device_(comm_.device_buffers()), slots_(m_.params.staging_slots),
        device_slots_(on_device_ ? slots_ : 0) {
    r_.held = DigestColumn(verify_ ? m_.entries.size() : 0);
    r_.expected = ExpectedDigests(m_.entries.size());
  }

  StreamResult Run() {
    const StreamStats plan = PlanStream(c_);
    const uint64_t total = plan.bytes_read + plan.bytes_received;
    std::optional<StagingRing> ring;
    if (route_.Reads(me_, verify_)) ring.emplace(m_, *c_.source, RingFor());
    Schedule schedule(m_);
    Message msg;
    uint64_t done = 0;
    while (schedule.Next(&msg)) {
      const Task t = route_.For(msg, me_, verify_);
      if (!t.any()) continue;
      FaultPoint("stream", me_);
      if (t.read) {
        Deliver(*ring, msg, t);
      } else {
        Receive(msg, t);
      }
      ++r_.stats.messages;
      done += msg.target_bytes;
      if (c_.progress) c_.progress(done, total);
    }
    while (!inflight_.empty()) Retire(*ring);
    if (ring) r_.stats.bytes_read = ring->bytes_read();
    return std::move(r_);
  }

 private:
  struct InFlight {
    StagingRing::Slot* slot;
    std::unique_ptr<PendingSend> send;
  };

  RingOptions RingFor() {
    RingOptions o;
    o.slots = slots_;
    o.readahead_bytes = c_.readahead_bytes;
    o.select = [this](const Message& msg) { return route_.For(msg, me_, verify_).read; };
    o.in_place = [this](const Message& msg) -> unsigned char* {
      const Task t = route_.For(msg, me_, verify_);
      if (!t.keep || t.send_to >= 0 || !msg.direct() || (t.broadcast && on_device_)) return nullptr;
      return c_.sink->HostDirect(msg.segments[0]);
    };
    return o;
  }

  void Retire(StagingRing& ring) {
    inflight_.front().send->Wait();
    ring.Free(inflight_.front().slot);
    inflight_.pop_front();
  }

  // This rank read `msg`: hash it, keep it, send or broadcast it.
  void Deliver(StagingRing& ring, const Message& msg, const Task& t) {
    // The slot the next message lands in may still be held by a send: finish that send first, or the
    // reader waits for the slot while we wait for the reader.
    while (!inflight_.empty() && inflight_.front().slot->index + slots_ <= next_slot_) Retire(ring);
    StagingRing::Slot* slot = ring.Next();
    if (slot == nullptr || slot->msg.seq != msg.seq) {
      throw Error(ErrorKind::kInternal, "stream", "the staging ring fell out of step with the schedule");
    }
    ++next_slot_;
    const unsigned char* data = slot->data;
    const uint64_t n = msg.target_bytes;
    if (t.verify) Expect(msg, data);
    if (t.broadcast) {
      unsigned char* wire = on_device_ ? device_slots_[slot->index % slots_].FromHost(data, n) : slot->data;
      comm_.Broadcast(wire, n, me_);
      r_.stats.bytes_sent += n * static_cast<uint64_t>(comm_.world_size() - 1);
    }
    if (t.keep) Keep(msg, data, slot->in_place);
    if (t.send_to >= 0) {
      const unsigned char* wire = on_device_ ? device_slots_[slot->index % slots_].FromHost(data, n) : data;
      inflight_.push_back({slot, comm_.SendAsync(wire, n, t.send_to)});
      r_.stats.bytes_sent += n;
      if (inflight_.size() >= std::max<size_t>(1, slots_ - 1)) Retire(ring);
    } else {
      ring.Free(slot);
    }
  }

  // This rank receives `msg` from the reader.
  void Receive(const Message& msg, const Task& t) {
    const uint64_t n = msg.target_bytes;
    const Segment& first = msg.segments[0];
    unsigned char* direct = nullptr;
    if (msg.direct()) direct = on_device_ ? c_.sink->DeviceDirect(first) : c_.sink->HostDirect(first);
    unsigned char* buf = direct ? direct : on_device_ ? device_bounce_.Get(n) : bounce_.Get(n);
    if (t.broadcast) {
      comm_.Broadcast(buf, n, t.peer);
    } else {
      comm_.Recv(buf, n, t.peer);
    }
    r_.stats.bytes_received += n;
    const unsigned char* host = buf;
    if (on_device_ && !direct) {
      device_bounce_.ToHost(bounce_.Get(n), n);
      host = bounce_.Get(n);
    } else if (on_device_ && verify_) {
      c_.sink->CopyDeviceToHost(first, bounce_.Get(n));
      host = bounce_.Get(n);
    }
    Keep(msg, host, direct != nullptr);
  }

  void Keep(const Message& msg, const unsigned char* data, bool in_place) {
    uint64_t off = 0;
    for (const Segment& s : msg.segments) {
      if (!in_place) c_.sink->Store(s, data + off);
      if (c_.sink->keeps()) r_.stats.bytes_stored += s.target_bytes;
      if (verify_) r_.held.Add(s.entry, SegmentDigest(data + off, s.target_bytes, s.local_offset));
      off += s.target_bytes;
    }
  }

  void Expect(const Message& msg, const unsigned char* data) {
    uint64_t off = 0;
    for (const Segment& s : msg.segments) {
      const uint64_t d = SegmentDigest(data + off, s.target_bytes, s.local_offset);
      if (msg.dest == kBroadcast) {
        for (int r = 0; r < comm_.world_size(); ++r) r_.expected.Add(r, s.entry, d);
      } else {
        r_.expected.Add(msg.dest, s.entry, d);
      }
      off += s.target_bytes;
    }
  }

  const StreamContext& c_;
  Communicator& comm_;
  const Manifest& m_;
  const Route& route_;
  const int me_;
  const bool verify_, on_device_;
  const uint32_t slots_;
  std::vector<DeviceBuffer> device_slots_;
  DeviceBuffer device_bounce_;
  Buffer bounce_;
  std::deque<InFlight> inflight_;
  uint64_t next_slot_ = 0;
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
  Schedule schedule(*c.manifest);
  Message msg;
  const int me = c.comm->rank();
  const bool verify = c.manifest->params.verify;
  while (schedule.Next(&msg)) {
    const Task t = c.route->For(msg, me, verify);
    if (!t.any()) continue;
    ++st.messages;
    if (t.read) st.bytes_read += msg.target_bytes;
    if (t.receive || (t.broadcast && !t.read)) st.bytes_received += msg.target_bytes;
  }
  return st;
}

StreamResult RunStream(const StreamContext& c) { return Engine(c).Run(); }

}  // namespace shardcast
