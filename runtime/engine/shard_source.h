// runtime/engine/shard_source: a save's SegmentSource, this rank's local tensors: the segment's bytes at its
// local offset (a device shard is copied to the host). Apart from source.h because it holds tensors:
// the rest of the sources are torch-free (the planning core).
//
// Thread safety: Read is called by the ring's reader thread only.
#pragma once

#include <ATen/core/Tensor.h>

#include <vector>

#include "runtime/stream/source.h"

namespace shardcast {

class ShardSource : public SegmentSource {
 public:
  explicit ShardSource(std::vector<at::Tensor> tensors) : tensors_(std::move(tensors)) {}
  void Read(const Segment& s, unsigned char* out) override;

 private:
  std::vector<at::Tensor> tensors_;  // one per manifest entry, CPU (a device shard is copied)
};

}  // namespace shardcast
