// allocators/pinned: page-locked host memory for staging, so device copies can run asynchronously.
//
// With CUDA in the build: cudaHostAlloc (portable) for new buffers, cudaHostRegister for memory the
// caller already owns. Without CUDA: every call throws kUnsupported ("unavailable in this build");
// there is no silent fallback to pageable memory. With CUDA but no usable device, kUnsupported
// names the CUDA error.
//
// Thread safety: thread-safe. PinnedBuffer is move-only and frees on destruction.
#pragma once

#include <cstddef>

#include "allocators/lazy_zero.h"

namespace shardcast {

bool PinnedAvailableInBuild();

class PinnedBuffer {
 public:
  PinnedBuffer() = default;
  static PinnedBuffer Allocate(size_t bytes);
  ~PinnedBuffer();
  PinnedBuffer(PinnedBuffer&& o) noexcept : data_(o.data_), bytes_(o.bytes_) { o.data_ = nullptr; o.bytes_ = 0; }
  PinnedBuffer& operator=(PinnedBuffer&& o) noexcept;
  PinnedBuffer(const PinnedBuffer&) = delete;
  PinnedBuffer& operator=(const PinnedBuffer&) = delete;

  void* data() const { return data_; }
  size_t size() const { return bytes_; }

 private:
  void* data_ = nullptr;
  size_t bytes_ = 0;
};

// Pins memory the caller owns, for as long as the returned guard lives.
class PinnedRegistration {
 public:
  PinnedRegistration(void* p, size_t bytes);
  ~PinnedRegistration();
  PinnedRegistration(const PinnedRegistration&) = delete;
  PinnedRegistration& operator=(const PinnedRegistration&) = delete;

 private:
  [[maybe_unused]] void* p_;  // used only in CUDA builds (unregistered in the destructor)
};

AllocatorStats PinnedStats();

}  // namespace shardcast
