#include "runtime/stream/staging_ring.h"

#include <algorithm>

#include "allocators/error.h"

namespace shardcast {

// Everything the reader thread touches once it may have been left behind: the source it may be inside,
// the slots the consumer takes (and their staging buffers, which sends read after the reader is done)
// and the state they share.
struct StagingRing::Core {
  Core(uint32_t n, std::shared_ptr<SegmentSource> s) : source(std::move(s)), slots(n), buffers(n) {}
  const std::shared_ptr<SegmentSource> source;
  std::mutex mu;
  std::condition_variable cv;
  std::vector<Slot> slots;
  std::vector<ScratchBuffer> buffers;
  bool stop = false, done = false, ended = false;
  bool in_source = false, abandoned = false;  // the reader is inside a source call; the ring left it behind
  uint64_t taken = 0, filled = 0, bytes_read = 0;
  uint64_t reading_seq = 0;  // what the reader reads now, for a deadline's error
  Segment reading;
  std::exception_ptr error;
};

struct StagingRing::Abandoned {};

StagingRing::StagingRing(ScheduleWalk& walk, int reader, int ahead, std::shared_ptr<SegmentSource> source,
                         RingOptions options)
    : walk_(&walk), reader_(reader), ahead_(ahead), o_(std::move(options)),
      core_(std::make_shared<Core>(o_.slots, std::move(source))) {
  Start();
}

StagingRing::StagingRing(const Manifest& m, std::shared_ptr<SegmentSource> source, RingOptions options)
    : own_walk_(std::make_unique<ScheduleWalk>(std::make_unique<Schedule>(m), 2)), walk_(own_walk_.get()), reader_(0),
      ahead_(1), o_(std::move(options)), core_(std::make_shared<Core>(o_.slots, std::move(source))) {
  Start();
}

void StagingRing::Start() {
  thread_ = std::thread([this, core = core_] { Run(core); });
}

// Stops the reader and joins it; one still inside a source call after abandon_after is left there.
StagingRing::~StagingRing() {
  Core& c = *core_;
  std::unique_lock<std::mutex> l(c.mu);
  c.stop = true;
  c.cv.notify_all();
  c.cv.wait_for(l, o_.abandon_after, [&] { return c.ended; });
  c.cv.wait(l, [&] { return c.ended || c.in_source; });  // out of a source call, it sees stop soon
  if (!c.ended) {
    c.abandoned = true;
    l.unlock();
    thread_.detach();
    return;
  }
  l.unlock();
  thread_.join();
}

StagingRing::Slot* StagingRing::Next(std::chrono::steady_clock::time_point deadline) {
  Core& c = *core_;
  std::unique_lock<std::mutex> l(c.mu);
  Slot& s = c.slots[c.taken % c.slots.size()];
  auto ready = [&] { return c.error || (s.filled && s.index == c.taken) || (c.done && c.filled == c.taken); };
  if (deadline == std::chrono::steady_clock::time_point::max()) {
    c.cv.wait(l, ready);
  } else if (!c.cv.wait_until(l, deadline, ready)) {
    const Segment& g = c.reading;
    throw Error(ErrorKind::kIo, "staging ring",
                "no message read by the deadline: the reader is still in message " + std::to_string(c.reading_seq) +
                    " (entry " + std::to_string(g.entry) + ", part " + std::to_string(g.part) + ", " +
                    std::to_string(g.source_bytes) + " bytes at source offset " + std::to_string(g.source_offset) +
                    "); is the storage hung?");
  }
  if (c.error) std::rethrow_exception(c.error);
  if (!(s.filled && s.index == c.taken)) return nullptr;
  ++c.taken;
  return &s;
}

void StagingRing::Free(Slot* s) {
  {
    std::lock_guard<std::mutex> l(core_->mu);
    s->filled = false;
  }
  core_->cv.notify_all();
}

uint64_t StagingRing::bytes_read() const {
  std::lock_guard<std::mutex> l(core_->mu);
  return core_->bytes_read;
}

// Runs `call` (a source call of message `seq`, segment `g`) marked as one, so the destructor may leave
// the reader in it; when it returns to a ring that is gone, throws Abandoned before anything of the ring
// is touched. Wakes the consumer only for a destructor waiting for it.
template <typename F>
void StagingRing::InSource(Core& core, uint64_t seq, const Segment& g, F&& call) {
  bool waited_for;
  {
    std::lock_guard<std::mutex> l(core.mu);
    core.in_source = true;
    core.reading_seq = seq;
    core.reading = g;
    waited_for = core.stop;
  }
  if (waited_for) core.cv.notify_all();
  bool abandoned = false;
  auto leave = [&] {
    std::lock_guard<std::mutex> l(core.mu);
    core.in_source = false;
    abandoned = core.abandoned;
  };
  try {
    call();
  } catch (...) {
    leave();
    if (abandoned) throw Abandoned{};
    throw;
  }
  leave();
  if (abandoned) throw Abandoned{};
}

// Asks for the file ranges of the selected messages up to `horizon` source bytes into the stream.
// `pending`: a message the read-ahead cursor produced but did not yet reach.
void StagingRing::Prefetch(Core& core, std::shared_ptr<const Message>* pending, uint64_t horizon) {
  while (prefetched_ < horizon) {
    if (!*pending && !(*pending = walk_->Next(ahead_))) return;
    if (o_.select(**pending)) {
      for (const Segment& s : (*pending)->segments) {
        InSource(core, (*pending)->seq, s, [&] { core.source->Prefetch(s); });
        prefetched_ += s.source_bytes;
      }
    }
    pending->reset();
  }
}

// The reader thread. `core` is its own reference: once the ring left it behind, `this` is gone.
void StagingRing::Run(const std::shared_ptr<Core>& core) {
  try {
    ReadAll(*core);
  } catch (const Abandoned&) {
    return;  // the ring is gone: touch nothing of it
  } catch (...) {
    std::lock_guard<std::mutex> l(core->mu);
    core->error = std::current_exception();
  }
  walk_->Close(reader_);  // its cursors no longer hold the walk's messages
  walk_->Close(ahead_);
  std::lock_guard<std::mutex> l(core->mu);
  core->ended = true;
  core->cv.notify_all();
}

void StagingRing::ReadAll(Core& c) {
  if (o_.readahead_bytes == 0) walk_->Close(ahead_);
  std::shared_ptr<const Message> next, pending;
  uint64_t read = 0;
  for (uint64_t index = 0; (next = walk_->Next(reader_));) {
    const Message& msg = *next;
    if (!o_.select(msg)) continue;
    if (o_.readahead_bytes > 0) Prefetch(c, &pending, read + o_.readahead_bytes);
    Slot& s = c.slots[index % c.slots.size()];
    {
      std::unique_lock<std::mutex> l(c.mu);
      c.cv.wait(l, [&] { return c.stop || !s.filled; });
      if (c.stop) return;
    }
    std::vector<unsigned char*> at;
    const bool in_place = o_.in_place && o_.in_place(msg, &at);
    unsigned char* data = nullptr;
    if (!in_place) {
      data = c.buffers[index % c.slots.size()].Get(std::max<uint64_t>(msg.target_bytes, 1));
      at.clear();
      uint64_t off = 0;
      for (const Segment& seg : msg.segments) {
        at.push_back(data + off);
        off += seg.target_bytes;
      }
    }
    for (size_t i = 0; i < msg.segments.size(); ++i) {
      InSource(c, msg.seq, msg.segments[i], [&] { c.source->Read(msg.segments[i], at[i]); });
      read += msg.segments[i].source_bytes;
    }
    {
      std::lock_guard<std::mutex> l(c.mu);
      s.msg = msg;
      s.data = data;
      s.at = std::move(at);
      s.in_place = in_place;
      s.index = index;
      s.filled = true;
      c.filled = ++index;
      c.bytes_read = read;
    }
    c.cv.notify_all();
  }
  std::lock_guard<std::mutex> l(c.mu);
  c.done = true;
}

}  // namespace shardcast
