// allocators/host_allocator: mimalloc-backed allocations for the many small and medium host objects
// (manifests, staging descriptors, metadata), with {current, peak, total} statistics.
//
// mimalloc is loaded privately (dlopen, RTLD_LOCAL): it serves these calls only and never replaces
// the process's malloc, so torch's own CPU allocations, and what the RSS benchmark measures of
// them, stay exactly what users get. Allocations are not zeroed (use lazy_zero.h for that).
//
// Thread safety: thread-safe. Failure: kIo when mimalloc cannot be loaded or memory is exhausted.
#pragma once

#include <cstddef>
#include <string>

#include "allocators/lazy_zero.h"

namespace shardcast {

class HostAllocator {
 public:
  static HostAllocator& Get();  // loads mimalloc on first use

  void* Allocate(size_t bytes);  // 16-byte aligned; never nullptr (throws instead)
  void Free(void* p);            // p from Allocate, or nullptr
  AllocatorStats stats() const;
  std::string backend() const;   // "mimalloc <version>"

 private:
  HostAllocator();
};

// An STL allocator over HostAllocator, for containers of descriptors.
template <typename T>
struct HostStlAllocator {
  using value_type = T;
  HostStlAllocator() = default;
  template <typename U>
  HostStlAllocator(const HostStlAllocator<U>&) {}
  T* allocate(size_t n) { return static_cast<T*>(HostAllocator::Get().Allocate(n * sizeof(T))); }
  void deallocate(T* p, size_t) { HostAllocator::Get().Free(p); }
  template <typename U>
  bool operator==(const HostStlAllocator<U>&) const { return true; }
  template <typename U>
  bool operator!=(const HostStlAllocator<U>&) const { return false; }
};

}  // namespace shardcast
