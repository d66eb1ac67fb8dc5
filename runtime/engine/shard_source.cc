#include "runtime/engine/shard_source.h"

#include <ATen/ATen.h>
#include <ATen/ops/from_blob.h>

#include <cstring>

namespace shardcast {

void ShardSource::Read(const Segment& s, unsigned char* out) {
  const at::Tensor& x = tensors_[s.entry];
  const uint64_t run = s.run_bytes();
  if (x.device().is_cpu()) {
    const auto* base = static_cast<const unsigned char*>(x.data_ptr()) + s.local_offset;
    if (s.local_contiguous()) {
      std::memcpy(out, base, s.target_bytes);
    } else {
      for (uint64_t i = 0; i < s.runs; ++i) std::memcpy(out + i * run, base + i * s.local_stride, run);
    }
    return;
  }
  // A device shard: its runs as one strided view, copied to the host in one call.
  at::Tensor bytes = x.view({-1}).view(at::kByte);
  at::Tensor window = s.local_contiguous()
                          ? bytes.narrow(0, static_cast<int64_t>(s.local_offset), static_cast<int64_t>(s.target_bytes))
                          : bytes.as_strided({static_cast<int64_t>(s.runs), static_cast<int64_t>(run)},
                                             {static_cast<int64_t>(s.local_stride), 1},
                                             static_cast<int64_t>(s.local_offset));
  at::from_blob(out, window.sizes(), at::kByte).copy_(window);
}

}  // namespace shardcast
