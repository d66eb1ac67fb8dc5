#include "runtime/staging_ring.h"

#include <algorithm>

#include "allocators/error.h"

namespace shardcast {
StagingRing::StagingRing(const Manifest& m, SegmentSource& source, RingOptions options)
    : m_(m), source_(source), o_(std::move(options)), slots_(o_.slots), buffers_(o_.slots) {
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
// `ahead` is a second walk of the schedule; `pending` a message it produced but did not yet reach.
void StagingRing::Prefetch(Schedule* ahead, Message* pending, uint64_t horizon) {
  while (prefetched_ < horizon) {
    if (pending->segments.empty() && !ahead->Next(pending)) return;
    if (o_.select(*pending)) {
      for (const Segment& s : pending->segments) {
        source_.Prefetch(s);
        prefetched_ += s.source_bytes;
      }
    }
    pending->segments.clear();
  }
}

void StagingRing::Run() {
  try {
    Schedule schedule(m_), ahead(m_);
    Message msg, pending;
    uint64_t read = 0;
    for (uint64_t index = 0; schedule.Next(&msg);) {
      if (!o_.select(msg)) continue;
      if (o_.readahead_bytes > 0) Prefetch(&ahead, &pending, read + o_.readahead_bytes);
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
        s.msg = std::move(msg);
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
