#include "allocators/memory_probe.h"

#include <gtest/gtest.h>
#include <sys/stat.h>

#include <cstring>
#include <thread>

#include "allocators/lazy_zero.h"
#include "tests/loaders/test_util.h"

namespace shardcast {
namespace {

TEST(MemoryProbe, ReadsThisProcess) {
  MemorySnapshot m = ReadMemory();
  EXPECT_GT(m.vm_rss, 0u);
  EXPECT_GE(m.vm_hwm, m.vm_rss);
  EXPECT_GT(m.rss_anon + m.rss_file, 0u);
  EXPECT_GE(m.vm_size, m.vm_rss);
}

TEST(MemoryProbe, ParsesEveryFieldFromAStatusFile) {
  testing::TempDir root;
  ASSERT_EQ(mkdir((root / "42").c_str(), 0755), 0);
  testing::WriteFile(root / "42/status",
                     "Name:\tx\nVmPeak:\t  900 kB\nVmSize:\t  800 kB\nVmHWM:\t  700 kB\nVmRSS:\t  600 kB\n"
                     "RssAnon:\t  500 kB\nRssFile:\t  90 kB\nRssShmem:\t  10 kB\n");
  MemorySnapshot m = ReadMemory(42, root.path());
  EXPECT_EQ(m.vm_peak, 900u * 1024);
  EXPECT_EQ(m.vm_size, 800u * 1024);
  EXPECT_EQ(m.vm_hwm, 700u * 1024);
  EXPECT_EQ(m.vm_rss, 600u * 1024);
  EXPECT_EQ(m.rss_anon, 500u * 1024);
  EXPECT_EQ(m.rss_file, 90u * 1024);
  EXPECT_EQ(m.rss_shmem, 10u * 1024);
}

TEST(MemoryProbe, UnreadableProcIsAClearError) {
  EXPECT_SC_ERROR(ReadMemory(0, "/nonexistent"), ErrorKind::kIo, "/nonexistent/self/status",
                  "cannot read the memory probe");
  testing::TempDir root;
  ASSERT_EQ(mkdir((root / "7").c_str(), 0755), 0);
  testing::WriteFile(root / "7/status", "Name:\tkthread\n");
  EXPECT_SC_ERROR(ReadMemory(7, root.path()), ErrorKind::kIo, "no VmRSS");
}

TEST(MemoryProbe, ResetPeakLowersVmHwmWhereAllowed) {
  const size_t n = 128u << 20;
  auto* p = static_cast<unsigned char*>(LazyZeroAllocate(n));
  std::memset(p, 1, n);
  LazyZeroFree(p, n);
  MemorySnapshot high = ReadMemory();
  ASSERT_GE(high.vm_hwm, high.vm_rss + n / 2);
  if (!ResetPeak()) GTEST_SKIP() << "/proc/self/clear_refs refused here; benchmarks fall back to one process per phase";
  MemorySnapshot low = ReadMemory();
  EXPECT_LT(low.vm_hwm, high.vm_hwm - n / 2);
}

TEST(MemoryProbe, SamplerSeesATransientAnonymousPeak) {
  PeakSampler sampler(0, std::chrono::milliseconds(1));
  uint64_t base = ReadMemory().rss_anon;
  const size_t n = 96u << 20;
  auto* p = static_cast<unsigned char*>(LazyZeroAllocate(n));
  std::memset(p, 1, n);
  std::this_thread::sleep_for(std::chrono::milliseconds(30));
  LazyZeroFree(p, n);
  MemoryPeaks peaks = sampler.Stop();
  EXPECT_GE(peaks.rss_anon, base + n - (4u << 20));
  EXPECT_LT(ReadMemory().rss_anon, peaks.rss_anon - n / 2);
}

}  // namespace
}  // namespace shardcast
