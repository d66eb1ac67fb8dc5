#include "allocators/lazy_zero.h"

#include <gtest/gtest.h>
#include <sys/mman.h>

#include <cstring>

#include "allocators/memory_probe.h"

namespace shardcast {
namespace {

constexpr size_t kBytes = 256u << 20;

TEST(LazyZero, CommitsNothingUntilWrittenAndReadsAsZeros) {
  MemorySnapshot before = ReadMemory();
  auto* p = static_cast<unsigned char*>(LazyZeroAllocate(kBytes));
  ASSERT_NE(p, nullptr);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(p) % 4096, 0u);
  uint64_t sum = 0;
  for (size_t i = 0; i < kBytes; i += 4096) sum += p[i];  // reads map the shared zero page
  EXPECT_EQ(sum, 0u);
  MemorySnapshot read = ReadMemory();
  EXPECT_LT(read.rss_anon, before.rss_anon + (8u << 20)) << "reading must not commit";
  EXPECT_GE(read.vm_size, before.vm_size + kBytes);
  std::memset(p, 0x7f, kBytes / 2);
  MemorySnapshot written = ReadMemory();
  EXPECT_GE(written.rss_anon, before.rss_anon + kBytes / 2 - (8u << 20)) << "writes commit";
  LazyZeroFree(p, kBytes);
  EXPECT_LT(ReadMemory().rss_anon, written.rss_anon - kBytes / 4) << "free unmaps";
}

// Regression for the empty_like NaN problem: memory written and freed never comes back non-zero.
TEST(LazyZero, NeverRecyclesWrittenMemory) {
  for (int round = 0; round < 20; ++round) {
    size_t bytes = (1u << 16) << (round % 5);
    auto* p = static_cast<unsigned char*>(LazyZeroAllocate(bytes));
    for (size_t i = 0; i < bytes; ++i) ASSERT_EQ(p[i], 0) << "round " << round << " byte " << i;
    std::memset(p, 0xff, bytes);  // bf16 0xffff is NaN
    LazyZeroFree(p, bytes);
  }
}

TEST(LazyZero, StatsTrackCurrentPeakTotal) {
  AllocatorStats s0 = LazyZeroStats();
  void* a = LazyZeroAllocate(1 << 20);
  void* b = LazyZeroAllocate(3);  // rounds up to a page
  AllocatorStats s1 = LazyZeroStats();
  EXPECT_EQ(s1.current_bytes - s0.current_bytes, (1u << 20) + 4096);
  EXPECT_GE(s1.peak_bytes, s1.current_bytes);
  EXPECT_EQ(s1.allocations - s0.allocations, 2u);
  LazyZeroFree(a, 1 << 20);
  LazyZeroFree(b, 3);
  AllocatorStats s2 = LazyZeroStats();
  EXPECT_EQ(s2.current_bytes, s0.current_bytes);
  EXPECT_EQ(s2.total_bytes - s0.total_bytes, (1u << 20) + 4096);
  EXPECT_EQ(LazyZeroAllocate(0), nullptr);
}

TEST(LazyZero, HugePagesOptionStillZeroAndLazy) {
  auto* p = static_cast<unsigned char*>(LazyZeroAllocate(8u << 20, LazyZeroOptions{true}));
  EXPECT_EQ(p[12345], 0);
  LazyZeroFree(p, 8u << 20);
}

// The commit before a load: fresh pages come in zeroed, pages already written keep their bytes, whether
// the range is partly written (the populate fills the gaps) or written in full (mincore sees it and the
// populate is skipped).
TEST(LazyZero, PrefaultForWriteCommitsTheGapsAndKeepsWrittenBytes) {
  constexpr size_t kRegion = 64u << 20;
  auto* p = static_cast<unsigned char*>(LazyZeroAllocate(kRegion));
  std::memset(p, 0x5a, kRegion / 4);  // the first quarter written
  const MemorySnapshot before = ReadMemory();
  if (!PrefaultForWrite(p, kRegion)) {
    LazyZeroFree(p, kRegion);
    GTEST_SKIP() << "MADV_POPULATE_WRITE is not in this kernel (Linux 5.14+)";
  }
  const MemorySnapshot after = ReadMemory();
  EXPECT_GE(after.rss_anon, before.rss_anon + kRegion * 3 / 4 - (8u << 20)) << "the unwritten 3/4 committed";
  for (size_t i = 0; i < kRegion; i += 4093) {
    ASSERT_EQ(p[i], i < kRegion / 4 ? 0x5a : 0) << "byte " << i;
  }
  std::memset(p, 0x33, kRegion);  // now written in full: a second commit changes nothing
  // Read-only, a populate for writing would fail: true here means mincore found every page and the
  // populate was skipped.
  ASSERT_EQ(mprotect(p, kRegion, PROT_READ), 0);
  EXPECT_TRUE(PrefaultForWrite(p + 1, kRegion - 1)) << "the whole pages inside, all present: skipped";
  EXPECT_FALSE(PrefaultForWrite(p + kRegion, 0));
  ASSERT_EQ(mprotect(p, kRegion, PROT_READ | PROT_WRITE), 0);
  for (size_t i = 0; i < kRegion; i += 4093) ASSERT_EQ(p[i], 0x33) << "byte " << i;
  EXPECT_FALSE(PrefaultForWrite(p + 1, 100)) << "no whole page inside";
  LazyZeroFree(p, kRegion);
}

}  // namespace
}  // namespace shardcast
