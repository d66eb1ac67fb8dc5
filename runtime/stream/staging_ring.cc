#include "runtime/stream/staging_ring.h"

#include <pthread.h>

#include <algorithm>
#include <system_error>

#include "allocators/error.h"
#include "allocators/lazy_zero.h"
#include "allocators/pinned.h"
#include "allocators/scratch_buffer.h"

namespace shardcast {

// Everything a reader thread touches once it may have been left behind: the source it may be inside,
// the slots the consumer takes (and their staging buffers, which sends read after the readers are done)
// and the state they share.
struct StagingRing::Core {
  Core(uint32_t n, uint32_t readers, std::shared_ptr<SegmentSource> s)
      : source(std::move(s)), slots(n), buffers(n), oversize(n), pins(n), turn(n), lanes(readers), running(readers) {
    for (uint32_t j = 0; j < n; ++j) turn[j] = j;
  }
  const std::shared_ptr<SegmentSource> source;
  std::mutex mu;
  std::condition_variable cv;
  std::vector<Slot> slots;
  std::vector<ScratchBuffer> buffers;
  std::vector<ScratchBuffer> oversize;  // a message larger than a pinned buffer, staged in pageable memory
  // The page-locking of each buffer: made and dropped by the ring's owner thread only; after `buffers`, so
  // that a registration left for the Core's end goes before its memory.
  std::vector<std::unique_ptr<PinnedRegistration>> pins;
  uint64_t pinned_bytes = 0;  // the pinned slots' size, set before the readers start (kept when pinning is refused)
  std::vector<uint64_t> turn;  // the message that may take slot j next: j, then each freed one's index + K
  struct Lane {                // what each reader is reading, for a deadline's error
    bool in_source = false;
    uint64_t seq = 0;
    Segment segment;
  };
  std::vector<Lane> lanes;
  uint32_t running;      // reader threads not yet ended
  uint32_t in_source = 0;
  bool stop = false, done = false, abandoned = false;  // done: every message claimed
  uint64_t claimed = 0, taken = 0, bytes_read = 0;
  std::exception_ptr error;
  // The claim: the reading cursor, one reader at a time; never held across a source call, so a reader
  // stuck in storage blocks no other (lock order: claim, then mu).
  std::mutex claim;
  uint64_t claimed_bytes = 0;
  // The read-ahead: one reader at a time, and a reader that finds another at it skips it (best effort).
  std::mutex ahead;
  std::shared_ptr<const Message> pending;  // a message the read-ahead cursor produced but did not yet reach
  uint64_t prefetched = 0;
};

struct StagingRing::Abandoned {};
struct StagingRing::Stopped {};

namespace {

uint32_t Readers(const RingOptions& o) { return std::max<uint32_t>(1, std::min(o.readers, std::max<uint32_t>(o.slots, 1))); }

}  // namespace

StagingRing::StagingRing(ScheduleWalk& walk, int reader, int ahead, std::shared_ptr<SegmentSource> source,
                         RingOptions options)
    : walk_(&walk), reader_(reader), ahead_(ahead), o_(std::move(options)),
      core_(std::make_shared<Core>(o_.slots, Readers(o_), std::move(source))) {
  Start();
}

StagingRing::StagingRing(const Manifest& m, std::shared_ptr<SegmentSource> source, RingOptions options)
    : own_walk_(std::make_unique<ScheduleWalk>(std::make_unique<Schedule>(m), 2)), walk_(own_walk_.get()), reader_(0),
      ahead_(1), o_(std::move(options)), core_(std::make_shared<Core>(o_.slots, Readers(o_), std::move(source))) {
  Start();
}

// Page-locks every slot's buffer at pin_bytes, or none (a partial set would make a slot's copy speed a
// lottery). Runs on the owner's thread while the readers already read into the buffers: the registration
// pins the pages they have faulted in so far and faults in the rest, and their bytes stay as they are. No
// copy leaves a slot before it returns (the consumer is this thread), so undoing a refused set is safe; by
// the same token the readers overlap it by one fill of the ring at most (no slot is freed before it ends).
void StagingRing::Pin(const std::vector<unsigned char*>& buffers) {
  Core& c = *core_;
  const auto t0 = std::chrono::steady_clock::now();
  try {
    // In 2 MiB pages where the kernel has them: the registration faults every page in at once, one fault
    // per 2 MiB instead of per 4 KiB. On an H100 host 64 MiB registered in 0.009-0.013 s and 256 MiB in
    // 0.034 s this way (bench/RESULTS.md); 4 KiB pages were not measured there.
    for (size_t k = 0; k < buffers.size(); ++k) {
      c.pins[k] = std::make_unique<PinnedRegistration>(buffers[k], o_.pin_bytes);
    }
    pinned_ = true;
  } catch (...) {  // refused (kUnsupported, kIo) or out of memory: pageable slots, and the readers, go on
    for (auto& p : c.pins) p.reset();
  }
  pin_seconds_ = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

void StagingRing::Start() {
  // Pinned slots are made at their full size before any reader runs, and never grown past it (a reader
  // stages a larger message beside them): the readers and the registration share no ScratchBuffer.
  std::vector<unsigned char*> pinning;
  if (o_.pin_bytes > 0) {
    for (ScratchBuffer& b : core_->buffers) pinning.push_back(b.Get(o_.pin_bytes, kHugePages));
    core_->pinned_bytes = o_.pin_bytes;
  }
  if (o_.readahead_bytes == 0) walk_->Close(ahead_);
  const uint32_t n = core_->running;
  threads_.reserve(n);
  for (uint32_t lane = 0; lane < n; ++lane) {
    try {
      threads_.emplace_back([this, core = core_, lane] { Run(core, lane); });
    } catch (const std::system_error&) {  // no thread to be had: read with those already running
      if (lane == 0) throw;
      std::lock_guard<std::mutex> l(core_->mu);
      core_->running -= n - lane;  // those never started (one already started may have ended)
      if (core_->running == 0) {    // every started one has ended, none of them as the last: close here
        walk_->Close(reader_);
        walk_->Close(ahead_);
      }
      break;
    }
  }
  if (!pinning.empty()) Pin(pinning);  // beside the first reads (their threads must not make CUDA calls)
}

// Stops the readers and joins them; those still inside a source call after abandon_after are left there.
StagingRing::~StagingRing() {
  Core& c = *core_;
  std::unique_lock<std::mutex> l(c.mu);
  c.stop = true;
  c.cv.notify_all();
  c.cv.wait_for(l, o_.abandon_after, [&] { return c.running == 0; });
  // Out of a source call, a reader sees stop soon: wait until every one still running is inside one.
  c.cv.wait(l, [&] { return c.running == c.in_source; });
  if (c.running > 0) {
    c.abandoned = true;
    l.unlock();
    for (std::thread& t : threads_) t.detach();
  } else {
    l.unlock();
    for (std::thread& t : threads_) t.join();
  }
  // Unpinned here, on the owner's thread; a reader left behind may still write into a buffer, which stays
  // mapped (pageable) until the Core goes.
  for (auto& p : c.pins) p.reset();
}

StagingRing::Slot* StagingRing::Next(std::chrono::steady_clock::time_point deadline) {
  Core& c = *core_;
  std::unique_lock<std::mutex> l(c.mu);
  Slot& s = c.slots[c.taken % c.slots.size()];
  auto ready = [&] { return c.error || (s.filled && s.index == c.taken) || (c.done && c.claimed == c.taken); };
  if (deadline == std::chrono::steady_clock::time_point::max()) {
    c.cv.wait(l, ready);
  } else if (!c.cv.wait_until(l, deadline, ready)) {
    // The reader in the earliest message is the one the consumer waits for.
    const Core::Lane* slowest = &c.lanes[0];
    for (const Core::Lane& lane : c.lanes) {
      if (lane.in_source && (!slowest->in_source || lane.seq < slowest->seq)) slowest = &lane;
    }
    if (!slowest->in_source) {
      throw Error(ErrorKind::kIo, "staging ring",
                  "no message read by the deadline, and no reader is in storage now (message " +
                      std::to_string(c.taken) + " of this rank's reads is still to come)");
    }
    const Segment& g = slowest->segment;
    throw Error(ErrorKind::kIo, "staging ring",
                "no message read by the deadline: the reader is still in message " + std::to_string(slowest->seq) +
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
    core_->turn[s->index % core_->slots.size()] = s->index + core_->slots.size();
  }
  core_->cv.notify_all();
}

uint64_t StagingRing::bytes_read() const {
  std::lock_guard<std::mutex> l(core_->mu);
  return core_->bytes_read;
}

// Runs `call` (a source call of message `seq`, segment `g`, on reader `lane`) marked as one, so the
// destructor may leave the reader in it; when it returns to a ring that is gone, throws Abandoned before
// anything of the ring is touched. Wakes the consumer only for a destructor waiting for it.
template <typename F>
void StagingRing::InSource(Core& core, uint32_t lane, uint64_t seq, const Segment& g, F&& call) {
  bool waited_for;
  {
    std::lock_guard<std::mutex> l(core.mu);
    if (core.stop) throw Stopped{};  // no new source call once the ring stops (a hung mount is not entered again)
    core.lanes[lane] = {true, seq, g};
    ++core.in_source;
    waited_for = core.stop;
  }
  if (waited_for) core.cv.notify_all();
  bool abandoned = false;
  auto leave = [&] {
    std::lock_guard<std::mutex> l(core.mu);
    core.lanes[lane].in_source = false;
    --core.in_source;
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
// REQUIRES: core.ahead held.
void StagingRing::Prefetch(Core& core, uint32_t lane, uint64_t horizon) {
  std::shared_ptr<const Message>& pending = core.pending;
  while (core.prefetched < horizon) {
    if (!pending && !(pending = walk_->Next(ahead_))) return;
    if (o_.select(*pending)) {
      for (const Segment& s : pending->segments) {
        InSource(core, lane, pending->seq, s, [&] { core.source->Prefetch(s); });
        core.prefetched += s.source_bytes;
      }
    }
    pending.reset();
  }
}

// The next selected message in schedule order for reader `lane`, and its index among them; nullptr when
// none is left or the ring stops.
std::shared_ptr<const Message> StagingRing::Claim(Core& c, uint32_t lane, uint64_t* index) {
  std::shared_ptr<const Message> next;
  uint64_t horizon = 0;
  {
    std::lock_guard<std::mutex> claim(c.claim);
    while ((next = walk_->Next(reader_)) && !o_.select(*next)) {
    }
    std::lock_guard<std::mutex> l(c.mu);
    if (!next || c.stop) {
      c.done = true;
      c.cv.notify_all();
      return nullptr;
    }
    horizon = c.claimed_bytes + o_.readahead_bytes;
    for (const Segment& s : next->segments) c.claimed_bytes += s.source_bytes;
    *index = c.claimed++;
  }
  if (o_.readahead_bytes > 0) {
    std::unique_lock<std::mutex> ahead(c.ahead, std::try_to_lock);
    if (ahead.owns_lock()) Prefetch(c, lane, horizon);
  }
  return next;
}

// A reader thread. `core` is its own reference: once the ring left it behind, `this` is gone.
void StagingRing::Run(const std::shared_ptr<Core>& core, uint32_t lane) {
  pthread_setname_np(pthread_self(), "shardcast-read");  // as top -H and perf name it
  try {
    ReadAll(*core, lane);
  } catch (const Abandoned&) {
    return;  // the ring is gone: touch nothing of it
  } catch (const Stopped&) {  // the ring stops: end as a reader that ran out of messages
  } catch (...) {
    std::lock_guard<std::mutex> l(core->mu);
    if (!core->error) core->error = std::current_exception();
    core->stop = true;  // the other readers end too
  }
  std::lock_guard<std::mutex> l(core->mu);
  if (core->running == 1) {  // the last reader: the walk's cursors no longer hold its messages
    walk_->Close(reader_);
    walk_->Close(ahead_);
  }
  --core->running;
  core->cv.notify_all();
}

void StagingRing::ReadAll(Core& c, uint32_t lane) {
  uint64_t index = 0;
  while (std::shared_ptr<const Message> next = Claim(c, lane, &index)) {
    const Message& msg = *next;
    const size_t k = index % c.slots.size();
    Slot& s = c.slots[k];
    {
      std::unique_lock<std::mutex> l(c.mu);
      c.cv.wait(l, [&] { return c.stop || c.turn[k] == index; });
      if (c.stop) return;
    }
    std::vector<unsigned char*> at;
    const bool in_place = o_.in_place && o_.in_place(msg, &at);
    unsigned char* data = nullptr;
    if (!in_place) {
      const uint64_t n = std::max<uint64_t>(msg.target_bytes, 1);
      // Never grown past its pinning size: the registration covers the buffer as it was made.
      data = c.pinned_bytes > 0 && n > c.pinned_bytes ? c.oversize[k].Get(n) : c.buffers[k].Get(n);
      at.clear();
      uint64_t off = 0;
      for (const Segment& seg : msg.segments) {
        at.push_back(data + off);
        off += seg.target_bytes;
      }
    }
    uint64_t read = 0;
    for (size_t i = 0; i < msg.segments.size(); ++i) {
      InSource(c, lane, msg.seq, msg.segments[i], [&] {
        // An in-place destination's missing whole pages, committed with one madvise before the read
        // rather than faulted one at a time inside pread's copy, which costs more (and is what warm
        // readers that overtook the commit beside them did): 1.91 GB into fresh memory through
        // dcp.load at one rank with two readers on the 2-core VM, warm, medians of 5 interleaved rounds,
        // 0.66 s against 0.71 s (bench/RESULTS.md, 2026-11-27). Inside the source call: a populate that
        // blocks (a memory cgroup's throttling) is a stuck reader the ring can leave behind.
        if (in_place) PrefaultForWrite(at[i], msg.segments[i].target_bytes);
        c.source->Read(msg.segments[i], at[i]);
      });
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
      c.bytes_read += read;
    }
    c.cv.notify_all();
  }
}

}  // namespace shardcast
