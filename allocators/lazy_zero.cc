#include "allocators/lazy_zero.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <string>

#include "allocators/error.h"
#include "allocators/stats_counter.h"

namespace shardcast {
namespace {

internal::StatsCounter g_stats;

size_t RoundToPages(size_t bytes) {
  static const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  return (bytes + page - 1) / page * page;
}

// Whether every page of [begin, begin + len) is present already (mincore, in steps of 512 pages into a
// buffer on the stack: no allocation, and the first absent page ends the walk). REQUIRES: begin and len
// page-aligned.
[[maybe_unused]] bool AllResident(uintptr_t begin, size_t len, uintptr_t page) {
  constexpr size_t kStep = 512;
  unsigned char resident[kStep];
  for (size_t done = 0; done < len;) {
    const size_t n = std::min(kStep, (len - done) / page);
    if (mincore(reinterpret_cast<void*>(begin + done), n * page, resident) != 0) return false;
    for (size_t i = 0; i < n; ++i) {
      if ((resident[i] & 1) == 0) return false;
    }
    done += n * page;
  }
  return true;
}

}  // namespace

void* LazyZeroAllocate(size_t bytes, const LazyZeroOptions& options) {
  if (bytes == 0) return nullptr;
  const size_t len = RoundToPages(bytes);
  void* p = mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED) {
    throw Error(ErrorKind::kIo, "lazy-zero allocator",
                "mmap of " + std::to_string(bytes) + " bytes refused: " + ErrnoText(errno));
  }
  if (options.huge_pages) madvise(p, len, MADV_HUGEPAGE);  // advisory; ignored where THP is off
  g_stats.Add(len);
  return p;
}

void LazyZeroFree(void* p, size_t bytes) {
  if (p == nullptr) return;
  const size_t len = RoundToPages(bytes);
  munmap(p, len);
  g_stats.Sub(len);
}

AllocatorStats LazyZeroStats() { return g_stats.Read(); }

bool PrefaultForWrite(void* p, size_t bytes) {
#ifdef MADV_POPULATE_WRITE
  static const uintptr_t page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  const uintptr_t begin = (reinterpret_cast<uintptr_t>(p) + page - 1) / page * page;
  const uintptr_t end = (reinterpret_cast<uintptr_t>(p) + bytes) / page * page;
  if (p == nullptr || end <= begin) return false;
  if (AllResident(begin, end - begin, page)) return true;
  return madvise(reinterpret_cast<void*>(begin), end - begin, MADV_POPULATE_WRITE) == 0;
#else
  (void)p;
  (void)bytes;
  return false;
#endif
}

}  // namespace shardcast
