// allocators/scratch_buffer: a scratch buffer grown on demand, for a reader's or writer's working bytes
// (the staging ring's slots, a conversion's raw bytes, a bounce copy).
//
// Get(n) returns at least n bytes, valid until the next Get that grows it. Memory is lazy-zero
// (allocators/lazy_zero.h: committed only where written, unmapped when it grows or dies); `options` as for
// LazyZeroAllocate, e.g. kHugePages for a buffer about to be page-locked whole, which faults every page in at
// once (the staging ring's slots for a CUDA target). In an
// AddressSanitizer build it comes from the heap instead (zeroed too), so that ASan sees its lifetime: a
// transport still reading a freed staging slot is a heap-use-after-free report (through its writev
// interceptor), not a silent read of an unmapped or reused page.
//
// Thread safety: one thread at a time. Failure: kIo (the mapping or allocation refused), naming the size.
#pragma once

#include <cstdint>

#include "allocators/lazy_zero.h"

namespace shardcast {

inline constexpr LazyZeroOptions kHugePages{/*huge_pages=*/true};

class ScratchBuffer {
 public:
  ScratchBuffer() = default;
  ScratchBuffer(const ScratchBuffer&) = delete;
  ScratchBuffer& operator=(const ScratchBuffer&) = delete;
  ~ScratchBuffer();
  unsigned char* Get(uint64_t bytes, const LazyZeroOptions& options = {});

 private:
  unsigned char* data_ = nullptr;
  uint64_t size_ = 0;
};

}  // namespace shardcast
