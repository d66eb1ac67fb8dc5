#include "runtime/source.h"

#include <ATen/ATen.h>
#include <ATen/ops/from_blob.h>

#include <algorithm>
#include <cstring>

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

void FileSource::Read(const Segment& s, unsigned char* out) {
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

void FileSource::Prefetch(const Segment& s) {
  files_[m_.entries[s.entry].parts[s.part].file]->Prefetch(s.source_offset, s.source_bytes);
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
