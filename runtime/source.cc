#include "runtime/source.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <string>

#include "allocators/error.h"
#include "allocators/lazy_zero.h"
#include "loaders/dequant.h"
#include "runtime/quant_parts.h"

namespace shardcast {
namespace {

constexpr uint64_t kReleaseStep = 8ull << 20;

}  // namespace

// Staging, forward and bounce buffers are lazy-zero mappings. In an AddressSanitizer build they come from
// the heap instead (zeroed too), so that ASan sees their lifetime: a transport still reading a freed
// staging slot is a heap-use-after-free report (through its writev interceptor), not a silent read of
// an unmapped or reused page.
#if defined(__SANITIZE_ADDRESS__)
#define SHARDCAST_ASAN_BUFFERS 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define SHARDCAST_ASAN_BUFFERS 1
#endif
#endif

namespace {
void* BufferAllocate(uint64_t bytes) {
#ifdef SHARDCAST_ASAN_BUFFERS
  void* p = std::calloc(bytes, 1);
  if (p == nullptr) throw Error(ErrorKind::kIo, "staging buffer", "cannot allocate " + std::to_string(bytes) + " bytes");
  return p;
#else
  return LazyZeroAllocate(bytes);
#endif
}
void BufferFree(void* p, uint64_t bytes) {
#ifdef SHARDCAST_ASAN_BUFFERS
  std::free(p);
#else
  LazyZeroFree(p, bytes);
#endif
}
}  // namespace

Buffer::~Buffer() { BufferFree(data_, size_); }

unsigned char* Buffer::Get(uint64_t bytes) {
  if (bytes > size_) {
    BufferFree(data_, size_);
    data_ = nullptr;
    size_ = 0;
    data_ = static_cast<unsigned char*>(BufferAllocate(bytes));
    size_ = bytes;
  }
  return data_;
}

// Rows [r0, r1) of an fp8 part: its bytes and the scale rows they need, dequantized into `out`.
//
//   part rows   |  r0 ......... r1 |            scale rows [r0 / bh, ceil(r1 / bh)), grid_cols wide
//   blocks   |-- bh --|-- bh --|-- bh --|       (a shard that starts mid-block reads its block's row)
void FileSource::Dequantize(const ManifestEntry& e, const ManifestPart& p, uint64_t r0, uint64_t r1, unsigned char* out) {
  const uint64_t cols = p.shape[1];
  const ManifestScale& sc = p.scale;
  const RowSpan rows{r0, r1}, scale_rows = ScaleRowsFor(rows, sc.block);
  const uint64_t ss = DTypeSize(sc.dtype), scale_bytes = scale_rows.size() * sc.grid_cols * ss;
  const uint64_t scale_at = sc.offset + scale_rows.begin * sc.grid_cols * ss;
  const uint64_t w_at = p.offset + r0 * cols * DTypeSize(p.source_dtype), w_bytes = (r1 - r0) * cols;
  unsigned char* raw = scratch_.Get(w_bytes + scale_bytes);
  const SafetensorsFile& wf = *files_[p.file];
  const SafetensorsFile& sf = *files_[sc.file];
  wf.ReadBytes(w_at, w_bytes, raw, "tensor '" + p.checkpoint_key + "'");
  sf.ReadBytes(scale_at, scale_bytes, raw + w_bytes, "tensor '" + sc.key + "'");
  shardcast::Dequantize(DequantSource{p.source_dtype, raw}, DequantScale{sc.dtype, raw + w_bytes, sc.grid_cols}, rows,
                        cols, sc.block, e.target_dtype, out);
  if (release_) {
    wf.ReleasePages(w_at, w_bytes);
    sf.ReleasePages(scale_at, scale_bytes);
  }
}

void FileSource::Read(const Segment& s, unsigned char* out) {
  const ManifestEntry& e = m_.entries[s.entry];
  const ManifestPart& p = e.parts[s.part];
  if (s.source_contiguous()) {
    ReadRun(e, p, s.first, s.runs * s.count, release_, out);
    return;
  }
  // A strided window (one run per row of a Shard(1) piece, say): the runs, then the span released once.
  const uint64_t ts = DTypeSize(e.target_dtype), ss = DTypeSize(p.source_dtype);
  for (uint64_t i = 0; i < s.runs; ++i) ReadRun(e, p, s.first + i * s.stride, s.count, false, out + i * s.count * ts);
  if (release_ && p.packing == Packing::kNone) {  // a packed part releases its own bytes
    const uint64_t span = ((s.runs - 1) * s.stride + s.count) * ss;
    files_[p.file]->ReleasePages(s.source_offset, span);
  }
}

void FileSource::ReadRun(const ManifestEntry& e, const ManifestPart& p, uint64_t first, uint64_t count, bool release,
                         unsigned char* out) {
  if (p.packing == Packing::kMxfp4) return ReadMxfp4(p, files_, first, count, e.target_dtype, &scratch_, release, out);
  if (p.packing == Packing::kNvfp4) return ReadNvfp4(p, files_, first, count, e.target_dtype, &scratch_, release, out);
  const uint64_t ss = DTypeSize(p.source_dtype), ts = DTypeSize(e.target_dtype);
  if (p.dequantize) {
    const uint64_t cols = p.shape[1];
    if (cols == 0) return;
    if (first % cols == 0 && count % cols == 0) {  // whole rows, in steps of about kReleaseStep
      const uint64_t r0 = first / cols, r1 = (first + count) / cols;
      const uint64_t step = std::max<uint64_t>(1, kReleaseStep / cols);
      for (uint64_t r = r0; r < r1; r += step) Dequantize(e, p, r, std::min(r1, r + step), out + (r - r0) * cols * ts);
      return;
    }
    // Part of a row or rows (a Shard(1) piece, a composed entry cut mid-row): each row it touches is
    // dequantized whole (its blocks need whole block rows anyway) and the window copied out.
    unsigned char* row = row_.Get(cols * ts);
    for (uint64_t at = first, left = count; left > 0;) {
      const uint64_t r = at / cols, c = at % cols, k = std::min(left, cols - c);
      Dequantize(e, p, r, r + 1, row);
      std::memcpy(out, row + c * ts, k * ts);
      out += k * ts, at += k, left -= k;
    }
    return;
  }
  const SafetensorsFile& f = *files_[p.file];
  const std::string what = "tensor '" + p.checkpoint_key + "'";
  // In steps of kReleaseStep, each released as soon as it is copied: the file pages mapped at once
  // stay a few MiB, not a whole chunk.
  const uint64_t offset = p.offset + first * ss, bytes = count * ss;
  const uint64_t step = std::max<uint64_t>(ss, kReleaseStep / ss * ss);
  for (uint64_t done = 0; done < bytes; done += step) {
    const uint64_t n = std::min(step, bytes - done);
    unsigned char* dst = out + done / ss * ts;
    if (p.source_dtype == e.target_dtype) {
      f.ReadBytes(offset + done, n, dst, what);
    } else {
      unsigned char* raw = scratch_.Get(n);
      f.ReadBytes(offset + done, n, raw, what);
      ConvertElements(p.source_dtype, e.target_dtype, raw, dst, n / ss);
    }
    if (release) f.ReleasePages(offset + done, n);
  }
}

void FileSource::Prefetch(const Segment& s) {
  const ManifestPart& p = m_.entries[s.entry].parts[s.part];
  const uint64_t last = (s.runs - 1) * s.stride + s.count;  // elements from `first` to the end of the last run
  if (p.packing == Packing::kMxfp4) return PrefetchMxfp4(p, files_, s.first, last);
  if (p.packing == Packing::kNvfp4) return PrefetchNvfp4(p, files_, s.first, last);
  files_[p.file]->Prefetch(s.source_offset, last * DTypeSize(p.source_dtype));
  if (p.dequantize && p.shape[1] > 0) {
    const ManifestScale& sc = p.scale;
    const uint64_t cols = p.shape[1];
    const RowSpan rows = ScaleRowsFor({s.first / cols, (s.first + last + cols - 1) / cols}, sc.block);
    const uint64_t ss = DTypeSize(sc.dtype);
    files_[sc.file]->Prefetch(sc.offset + rows.begin * sc.grid_cols * ss, rows.size() * sc.grid_cols * ss);
  }
}

}  // namespace shardcast
