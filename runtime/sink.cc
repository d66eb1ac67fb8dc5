#include "runtime/sink.h"

#include <ATen/ATen.h>
#include <ATen/ops/from_blob.h>

#include <cstring>

namespace shardcast {

unsigned char* ShardSink::HostDirect(const Segment& s) {
  const at::Tensor& x = tensors_[s.entry];
  if (!x.defined() || !x.device().is_cpu()) return nullptr;
  return static_cast<unsigned char*>(x.data_ptr()) + s.local_offset;
}

unsigned char* ShardSink::DeviceDirect(const Segment& s) {
  const at::Tensor& x = tensors_[s.entry];
  if (!x.defined() || !x.device().is_cuda()) return nullptr;
  return static_cast<unsigned char*>(x.data_ptr()) + s.local_offset;
}

at::Tensor ShardSink::Bytes(const Segment& s) {
  return tensors_[s.entry].view({-1}).view(at::kByte).narrow(0, static_cast<int64_t>(s.local_offset),
                                                             static_cast<int64_t>(s.target_bytes));
}

void ShardSink::Store(const Segment& s, const unsigned char* data) {
  if (unsigned char* p = HostDirect(s)) {
    std::memcpy(p, data, s.target_bytes);
    return;
  }
  at::Tensor src = at::from_blob(const_cast<unsigned char*>(data), {static_cast<int64_t>(s.target_bytes)}, at::kByte);
  Bytes(s).copy_(src);
}

void ShardSink::CopyDeviceToHost(const Segment& s, unsigned char* out) {
  at::from_blob(out, {static_cast<int64_t>(s.target_bytes)}, at::kByte).copy_(Bytes(s));
}

}  // namespace shardcast
