#include "allocators/host_allocator.h"

#include <dlfcn.h>

#include <cstdlib>
#include <string>

#include "allocators/error.h"
#include "allocators/stats_counter.h"

namespace shardcast {
namespace {

struct Mimalloc {
  void* (*malloc)(size_t) = nullptr;
  void (*free)(void*) = nullptr;
  size_t (*usable_size)(const void*) = nullptr;
  int (*version)() = nullptr;
};

Mimalloc Load() {
  const char* candidates[] = {SHARDCAST_MIMALLOC_SONAME, "libmimalloc.so.2", "libmimalloc.so"};
  void* h = nullptr;
  std::string tried;
  for (const char* name : candidates) {
    h = dlopen(name, RTLD_NOW | RTLD_LOCAL);
    if (h != nullptr) break;
    tried += std::string(tried.empty() ? "" : "; ") + dlerror();
  }
  if (h == nullptr) throw Error(ErrorKind::kIo, "host allocator", "cannot load mimalloc: " + tried);
  Mimalloc m;
  m.malloc = reinterpret_cast<void* (*)(size_t)>(dlsym(h, "mi_malloc"));
  m.free = reinterpret_cast<void (*)(void*)>(dlsym(h, "mi_free"));
  m.usable_size = reinterpret_cast<size_t (*)(const void*)>(dlsym(h, "mi_usable_size"));
  m.version = reinterpret_cast<int (*)()>(dlsym(h, "mi_version"));
  if (!m.malloc || !m.free || !m.usable_size || !m.version) {
    throw Error(ErrorKind::kIo, "host allocator", "mimalloc lacks mi_malloc/mi_free/mi_usable_size/mi_version");
  }
  return m;
}

const Mimalloc& Mi() {
  static const Mimalloc m = Load();
  return m;
}

internal::StatsCounter g_stats;

}  // namespace

HostAllocator::HostAllocator() { Mi(); }

HostAllocator& HostAllocator::Get() {
  static HostAllocator instance;
  return instance;
}

// Under ThreadSanitizer, the process heap: TSan cannot see mimalloc's (uninstrumented) reuse of freed
// memory, and would report every reused block as a race.
#if defined(__SANITIZE_THREAD__)
void* HostAllocator::Allocate(size_t bytes) { return std::malloc(bytes == 0 ? 1 : bytes); }
void HostAllocator::Free(void* p) { std::free(p); }
#else
void* HostAllocator::Allocate(size_t bytes) {
  void* p = Mi().malloc(bytes == 0 ? 1 : bytes);
  if (p == nullptr) {
    throw Error(ErrorKind::kIo, "host allocator", "out of memory allocating " + std::to_string(bytes) + " bytes");
  }
  g_stats.Add(Mi().usable_size(p));
  return p;
}

void HostAllocator::Free(void* p) {
  if (p == nullptr) return;
  g_stats.Sub(Mi().usable_size(p));
  Mi().free(p);
}
#endif

AllocatorStats HostAllocator::stats() const { return g_stats.Read(); }

std::string HostAllocator::backend() const {
  int v = Mi().version();
  return "mimalloc " + std::to_string(v / 100) + "." + std::to_string((v / 10) % 10) + "." + std::to_string(v % 10);
}

}  // namespace shardcast
