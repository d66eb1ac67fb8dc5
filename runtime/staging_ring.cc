#include "runtime/staging_ring.h"

#include <algorithm>

#include "allocators/error.h"

namespace shardcast {
StagingRing::StagingRing(ScheduleWalk& walk, int reader, int ahead, SegmentSource& source, RingOptions options)
    : walk_(&walk), reader_(reader), ahead_(ahead), source_(source), o_(std::move(options)), slots_(o_.slots),
      buffers_(o_.slots) {
  Start();
}

StagingRing::StagingRing(const Manifest& m, SegmentSource& source, RingOptions options)
    : own_walk_(std::make_unique<ScheduleWalk>(std::make_unique<Schedule>(m), 2)), walk_(own_walk_.get()), reader_(0),
      ahead_(1), source_(source), o_(std::move(options)), slots_(o_.slots), buffers_(o_.slots) {
  Start();
}

void StagingRing::Start() {
  thread_ = std::thread([this] { Run(); });
}

StagingRing::~StagingRing() {
  {
    std::lock_guard<std::mutex> l(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

StagingRing::Slot* StagingRing::Next() {
  std::unique_lock<std::mutex> l(mu_);
  Slot& s = slots_[taken_ % slots_.size()];
  cv_.wait(l, [&] { return error_ || (s.filled && s.index == taken_) || (done_ && filled_ == taken_); });
  if (error_) std::rethrow_exception(error_);
  if (!(s.filled && s.index == taken_)) return nullptr;
  ++taken_;
  return &s;
}

void StagingRing::Free(Slot* s) {
  {
    std::lock_guard<std::mutex> l(mu_);
    s->filled = false;
  }
  cv_.notify_all();
}

// Asks for the file ranges of the selected messages up to `horizon` source bytes into the stream.
// `pending`: a message the read-ahead cursor produced but did not yet reach.
void StagingRing::Prefetch(std::shared_ptr<const Message>* pending, uint64_t horizon) {
  while (prefetched_ < horizon) {
    if (!*pending && !(*pending = walk_->Next(ahead_))) return;
    if (o_.select(**pending)) {
      for (const Segment& s : (*pending)->segments) {
        source_.Prefetch(s);
        prefetched_ += s.source_bytes;
      }
    }
    pending->reset();
  }
}

void StagingRing::Run() {
  struct CloseCursors {  // whatever ends the thread, its cursors no longer hold the walk's messages
    StagingRing* ring;
    ~CloseCursors() {
      ring->walk_->Close(ring->reader_);
      ring->walk_->Close(ring->ahead_);
    }
  } close{this};
  try {
    if (o_.readahead_bytes == 0) walk_->Close(ahead_);
    std::shared_ptr<const Message> next, pending;
    uint64_t read = 0;
    for (uint64_t index = 0; (next = walk_->Next(reader_));) {
      const Message& msg = *next;
      if (!o_.select(msg)) continue;
      if (o_.readahead_bytes > 0) Prefetch(&pending, read + o_.readahead_bytes);
      Slot& s = slots_[index % slots_.size()];
      {
        std::unique_lock<std::mutex> l(mu_);
        cv_.wait(l, [&] { return stop_ || !s.filled; });
        if (stop_) return;
      }
      std::vector<unsigned char*> at;
      const bool in_place = o_.in_place && o_.in_place(msg, &at);
      unsigned char* data = nullptr;
      if (!in_place) {
        data = buffers_[index % slots_.size()].Get(std::max<uint64_t>(msg.target_bytes, 1));
        at.clear();
        uint64_t off = 0;
        for (const Segment& seg : msg.segments) {
          at.push_back(data + off);
          off += seg.target_bytes;
        }
      }
      for (size_t i = 0; i < msg.segments.size(); ++i) {
        source_.Read(msg.segments[i], at[i]);
        read += msg.segments[i].source_bytes;
      }
      {
        std::lock_guard<std::mutex> l(mu_);
        s.msg = msg;
        s.data = data;
        s.at = std::move(at);
        s.in_place = in_place;
        s.index = index;
        s.filled = true;
        filled_ = ++index;
        bytes_read_ = read;
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

}  // namespace shardcast
