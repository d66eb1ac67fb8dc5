#include "runtime/source.h"

#include <ATen/ATen.h>
#include <ATen/ops/from_blob.h>

#include <algorithm>
#include <cstring>

#include "allocators/error.h"
#include "allocators/lazy_zero.h"
#include "loaders/dequant.h"
#include "runtime/quant_parts.h"

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
  if (p.packing == Packing::kMxfp4) return ReadMxfp4(p, files_, s.first, s.count, e.target_dtype, &scratch_, release_, out);
  if (p.dequantize) {
    // The schedule cuts a part on its rows: whole rows, taken in steps of about kReleaseStep.
    const uint64_t cols = p.shape[1];
    if (cols == 0 || s.first % cols != 0 || s.count % cols != 0) {
      throw Error(ErrorKind::kInternal, "key '" + e.key + "'", "a segment of an fp8 part does not fall on its rows");
    }
    const uint64_t r0 = s.first / cols, r1 = (s.first + s.count) / cols;
    const uint64_t step = std::max<uint64_t>(1, kReleaseStep / cols), ts = DTypeSize(e.target_dtype);
    for (uint64_t r = r0; r < r1; r += step) Dequantize(e, p, r, std::min(r1, r + step), out + (r - r0) * cols * ts);
    return;
  }
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

void FileSource::Prefetch(const Segment& s) {
  const ManifestPart& p = m_.entries[s.entry].parts[s.part];
  if (p.packing == Packing::kMxfp4) return PrefetchMxfp4(p, files_, s.first, s.count);
  files_[p.file]->Prefetch(s.source_offset, s.source_bytes);
  if (p.dequantize && p.shape[1] > 0) {
    const ManifestScale& sc = p.scale;
    const RowSpan rows = ScaleRowsFor({s.first / p.shape[1], (s.first + s.count) / p.shape[1]}, sc.block);
    const uint64_t ss = DTypeSize(sc.dtype);
    files_[sc.file]->Prefetch(sc.offset + rows.begin * sc.grid_cols * ss, rows.size() * sc.grid_cols * ss);
  }
}

void ShardSource::Read(const Segment& s, unsigned char* out) {
  const at::Tensor& x = tensors_[s.entry];
  if (x.device().is_cpu()) {
    std::memcpy(out, static_cast<const unsigned char*>(x.data_ptr()) + s.local_offset, s.target_bytes);
    return;
  }
  at::from_blob(out, {static_cast<int64_t>(s.target_bytes)}, at::kByte)
      .copy_(x.view({-1}).view(at::kByte).narrow(0, static_cast<int64_t>(s.local_offset),
                                                 static_cast<int64_t>(s.target_bytes)));
}

}  // namespace shardcast
