#include "runtime/engine/sink.h"

#include <ATen/ATen.h>
#include <ATen/ops/from_blob.h>

#include <cstring>

#include "allocators/lazy_zero.h"

namespace shardcast {

ShardSink::ShardSink(std::vector<at::Tensor> tensors) : tensors_(std::move(tensors)) {
  for (at::Tensor& t : tensors_) {
    if (t.defined()) t = t.detach();
  }
}

unsigned char* ShardSink::HostDirect(const Segment& s) {
  const at::Tensor& x = tensors_[s.entry];
  if (!x.defined() || !x.device().is_cpu() || !s.local_contiguous()) return nullptr;
  return static_cast<unsigned char*>(x.data_ptr()) + s.local_offset;
}

unsigned char* ShardSink::DeviceDirect(const Segment& s) {
  const at::Tensor& x = tensors_[s.entry];
  if (!x.defined() || !x.device().is_cuda() || !s.local_contiguous()) return nullptr;
  return static_cast<unsigned char*>(x.data_ptr()) + s.local_offset;
}

// The segment's bytes in the local tensor: [runs, run bytes] at local_stride apart.
at::Tensor ShardSink::Bytes(const Segment& s) {
  at::Tensor bytes = tensors_[s.entry].view({-1}).view(at::kByte);
  return bytes.as_strided({static_cast<int64_t>(s.runs), static_cast<int64_t>(s.run_bytes())},
                          {static_cast<int64_t>(s.local_stride), 1}, static_cast<int64_t>(s.local_offset));
}

void ShardSink::Store(const Segment& s, const unsigned char* data) {
  const at::Tensor& x = tensors_[s.entry];
  if (x.defined() && x.device().is_cpu()) {
    auto* base = static_cast<unsigned char*>(x.data_ptr()) + s.local_offset;
    if (s.local_contiguous()) {
      PrefaultForWrite(base, s.target_bytes);  // its missing pages in one call, not one fault each in the copy
      std::memcpy(base, data, s.target_bytes);
    } else {
      const uint64_t run = s.run_bytes();
      for (uint64_t i = 0; i < s.runs; ++i) std::memcpy(base + i * s.local_stride, data + i * run, run);
    }
    return;
  }
  at::Tensor src = at::from_blob(const_cast<unsigned char*>(data),
                                 {static_cast<int64_t>(s.runs), static_cast<int64_t>(s.run_bytes())}, at::kByte);
  Bytes(s).copy_(src);
}

void ShardSink::CopyDeviceToHost(const Segment& s, unsigned char* out) {
  at::from_blob(out, {static_cast<int64_t>(s.runs), static_cast<int64_t>(s.run_bytes())}, at::kByte).copy_(Bytes(s));
}

}  // namespace shardcast
