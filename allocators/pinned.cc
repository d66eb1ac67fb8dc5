#include "allocators/pinned.h"

#include <string>

#include "allocators/error.h"
#include "allocators/stats_counter.h"
#include "shardcast_config.h"

#if SHARDCAST_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif

namespace shardcast {
namespace {

internal::StatsCounter g_stats;

[[noreturn]] void Unavailable(const std::string& why) {
  throw Error(ErrorKind::kUnsupported, "pinned host memory", why);
}

}  // namespace

bool PinnedAvailableInBuild() { return SHARDCAST_HAVE_CUDA != 0; }

#if SHARDCAST_HAVE_CUDA

PinnedBuffer PinnedBuffer::Allocate(size_t bytes) {
  PinnedBuffer b;
  if (bytes == 0) return b;
  cudaError_t rc = cudaHostAlloc(&b.data_, bytes, cudaHostAllocPortable);
  if (rc != cudaSuccess) {
    cudaGetLastError();  // clear the sticky error so later CUDA calls are not blamed for it
    Unavailable("cudaHostAlloc of " + std::to_string(bytes) + " bytes failed: " + cudaGetErrorString(rc));
  }
  b.bytes_ = bytes;
  g_stats.Add(bytes);
  return b;
}

PinnedBuffer::~PinnedBuffer() {
  if (data_ != nullptr) {
    cudaFreeHost(data_);
    g_stats.Sub(bytes_);
  }
}

PinnedRegistration::PinnedRegistration(void* p, size_t bytes) : p_(p) {
  cudaError_t rc = cudaHostRegister(p, bytes, cudaHostRegisterPortable);
  if (rc != cudaSuccess) {
    cudaGetLastError();
    Unavailable("cudaHostRegister of " + std::to_string(bytes) + " bytes failed: " + cudaGetErrorString(rc));
  }
}

PinnedRegistration::~PinnedRegistration() { cudaHostUnregister(p_); }

#else

PinnedBuffer PinnedBuffer::Allocate(size_t) { Unavailable("unavailable in this build (built without CUDA)"); }
PinnedBuffer::~PinnedBuffer() = default;
PinnedRegistration::PinnedRegistration(void* p, size_t) : p_(p) {
  Unavailable("unavailable in this build (built without CUDA)");
}
PinnedRegistration::~PinnedRegistration() = default;

#endif

PinnedBuffer& PinnedBuffer::operator=(PinnedBuffer&& o) noexcept {
  if (this != &o) {
    PinnedBuffer old(std::move(*this));
    data_ = o.data_;
    bytes_ = o.bytes_;
    o.data_ = nullptr;
    o.bytes_ = 0;
  }
  return *this;
}

AllocatorStats PinnedStats() { return g_stats.Read(); }

}  // namespace shardcast
