// allocators/lazy_zero: zeros at the cost of empty.
//
// Every allocation is a fresh MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE mapping. The kernel hands
// out such pages zero-filled and commits each only when first written, so an untouched allocation
// costs no RSS and reads as zeros. Memory is never recycled: Free unmaps, and the next allocation
// is a new mapping, so no caller ever sees another's bytes (unlike empty_like from a heap).
//
// Thread safety: all functions are thread-safe. Failure: kIo (mmap refused), naming the size.
#pragma once

#include <cstddef>
#include <cstdint>

namespace shardcast {

struct LazyZeroOptions {
  bool huge_pages = false;  // default false. true: MADV_HUGEPAGE (2 MiB pages once touched; fewer faults)
};

struct AllocatorStats {
  uint64_t current_bytes = 0;  // live now
  uint64_t peak_bytes = 0;     // most live at once
  uint64_t total_bytes = 0;    // all ever allocated
  uint64_t allocations = 0;    // count ever allocated
};

// Returns a zero-filled, page-aligned region of `bytes` (rounded up to pages); nullptr for 0 bytes.
void* LazyZeroAllocate(size_t bytes, const LazyZeroOptions& options = {});
// REQUIRES: p from LazyZeroAllocate with the same bytes.
void LazyZeroFree(void* p, size_t bytes);
AllocatorStats LazyZeroStats();

// Commits the whole pages inside [p, p + bytes) for writing in one call (MADV_POPULATE_WRITE, Linux
// 5.14+), for memory about to be written in full: the kernel zero-fills them in a batch instead of one
// trapped fault per 4 KiB page, which a pread into fresh memory pays from inside the kernel's copy (about
// 1.8 against 2.2 GB/s on the dev VM, bench in the commit that added this). Pages already present are
// left as they are (their bytes too). A range whose pages mincore reports all present is left alone
// without the populate's fault-in walk (memory the caller wrote before a load: torchtitan's init_weights,
// a second load into the same model). mincore also calls present a page the populate would still have
// made writable (the shared zero page after a read, copy-on-write after a fork, a file mapping's cached
// page): the writes then fault as they would without this call; bytes are never affected.
// Best effort: returns whether the range is committed or found present; false, having done nothing,
// where `bytes` holds no whole page or the kernel lacks MADV_POPULATE_WRITE (or refused it); never throws.
bool PrefaultForWrite(void* p, size_t bytes);

}  // namespace shardcast
