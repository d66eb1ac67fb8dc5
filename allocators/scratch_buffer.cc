#include "allocators/scratch_buffer.h"

#include <cstdlib>
#include <string>

#include "allocators/error.h"
#include "allocators/lazy_zero.h"

#if defined(__SANITIZE_ADDRESS__)
#define SHARDCAST_ASAN_BUFFERS 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define SHARDCAST_ASAN_BUFFERS 1
#endif
#endif

namespace shardcast {
namespace {

void* Allocate(uint64_t bytes, const LazyZeroOptions& options) {
#ifdef SHARDCAST_ASAN_BUFFERS
  (void)options;  // the heap's pages
  void* p = std::calloc(bytes, 1);
  if (p == nullptr) throw Error(ErrorKind::kIo, "scratch buffer", "cannot allocate " + std::to_string(bytes) + " bytes");
  return p;
#else
  return LazyZeroAllocate(bytes, options);
#endif
}

void Free(void* p, uint64_t bytes) {
#ifdef SHARDCAST_ASAN_BUFFERS
  std::free(p);
#else
  LazyZeroFree(p, bytes);
#endif
}

}  // namespace

ScratchBuffer::~ScratchBuffer() { Free(data_, size_); }

unsigned char* ScratchBuffer::Get(uint64_t bytes, const LazyZeroOptions& options) {
  if (bytes > size_) {
    Free(data_, size_);
    data_ = nullptr;
    size_ = 0;
    data_ = static_cast<unsigned char*>(Allocate(bytes, options));
    size_ = bytes;
  }
  return data_;
}

}  // namespace shardcast
