#include "runtime/staging_ring.h"

#include <algorithm>

#include "allocators/error.h"
#include "allocators/lazy_zero.h"

namespace shardcast {
namespace {

constexpr uint64_t kReleaseStep = 8ull << 20;

}  // namespace

Buffer::~Buffer() { LazyZeroFree(data_, size_); }

unsigned char* Buffer::Get(uint64_t bytes) {
  if (bytes > size_) {
    LazyZeroFree(data_, size_);
    data_ = nullptr;
    size_ = 0;
    data_ = static_cast<unsigned char*>(LazyZeroAllocate(bytes));
    size_ = bytes;
  }
  return data_;
}

void PartReader::Read(const Segment& s, unsigned char* out) {
  const ManifestEntry& e = m_.entries[s.entry];
  const ManifestPart& p = e.parts[s.part];
  const SafetensorsFile& f = *files_[p.file];
  const std::string what = "tensor '" + p.checkpoint_key + "'";
  // In steps of kReleaseStep, each released as soon as it is copied: the file pages mapped at once
  // stay a few MiB, not a whole chunk.
  const uint64_t ss = DTypeSize(p.source_dtype), ts = DTypeSize(e.target_dtype);
  const uint64_t step = std::max<uint64_t>(ss, kReleaseStep / ss * ss);
  for (uint64_t done = 0; done < s.source_bytes; done += step) {
    const uint64_t n = std::min(step, s.source_bytes - done);
    unsigned char* dst = out + done / ss * ts;
    if (p.source_dtype == e.target_dtype) {
      f.ReadBytes(s.source_offset + done, n, dst, what);
    } else {
      unsigned char* raw = scratch_.Get(n);
      f.ReadBytes(s.source_offset + done, n, raw, what);
      ConvertElements(p.source_dtype, e.target_dtype, raw, dst, n / ss);
    }
    if (release_) f.ReleasePages(s.source_offset + done, n);
  }
}

StagingRing::StagingRing(const Manifest& m, const FileTable& files, RingOptions options)
    : m_(m), files_(files), o_(std::move(options)), slots_(o_.slots), buffers_(o_.slots) {
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
      // Contiguous segments of one file become one request.
      uint32_t file = UINT32_MAX;
      uint64_t begin = 0, end = 0;
      for (const Segment& s : pending->segments) {
        const uint32_t f = m_.entries[s.entry].parts[s.part].file;
        if (f == file && s.source_offset == end) {
          end += s.source_bytes;
        } else {
          if (file != UINT32_MAX) files_[file]->Prefetch(begin, end - begin);
          file = f, begin = s.source_offset, end = s.source_offset + s.source_bytes;
        }
        prefetched_ += s.source_bytes;
      }
      if (file != UINT32_MAX) files_[file]->Prefetch(begin, end - begin);
    }
    pending->segments.clear();
  }
}

void StagingRing::Run() {
  try {
    PartReader reader(m_, files_, o_.release_pages);
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
      unsigned char* data = o_.in_place ? o_.in_place(msg) : nullptr;
      const bool in_place = data != nullptr;
      if (!in_place) data = buffers_[index % slots_.size()].Get(std::max<uint64_t>(msg.target_bytes, 1));
      uint64_t off = 0;
      for (const Segment& seg : msg.segments) {
        reader.Read(seg, data + off);
        off += seg.target_bytes;
        read += seg.source_bytes;
      }
      {
        std::lock_guard<std::mutex> l(mu_);
        s.msg = std::move(msg);
        s.data = data;
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
