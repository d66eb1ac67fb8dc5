// ScratchBuffer: the 2 MiB-page advice reaches the mapping only where it is asked for.
#include "allocators/scratch_buffer.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <fstream>
#include <string>

#include "tests/loaders/test_util.h"

namespace shardcast {
namespace {

// The mapping holding `p` (an empty one where none holds it).
testing::Mapping MappingOf(const void* p) {
  const auto at = reinterpret_cast<uintptr_t>(p);
  for (const testing::Mapping& m : testing::Smaps()) {
    if (m.begin <= at && at < m.end) return m;
  }
  return {};
}

// A scratch buffer asked for huge pages (the staging ring's page-locked slots) is advised MADV_HUGEPAGE
// ("hg" in its VmFlags); one that is not keeps 4 KiB pages.
TEST(ScratchBuffer, HugePagesOnlyWhereAskedFor) {
#if defined(__SANITIZE_ADDRESS__)
  GTEST_SKIP() << "an ASan build's scratch buffers come from the heap";
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
  GTEST_SKIP() << "an ASan build's scratch buffers come from the heap";
#endif
#endif
  if (!std::ifstream("/sys/kernel/mm/transparent_hugepage/enabled")) GTEST_SKIP() << "no THP in this kernel";
  ScratchBuffer huge, plain;
  unsigned char* h = huge.Get(8u << 20, kHugePages);
  unsigned char* q = plain.Get(8u << 20);
  h[0] = q[0] = 1;
  if (MappingOf(q).vm_flags.empty()) GTEST_SKIP() << "no VmFlags in /proc/self/smaps (a sandboxed kernel)";
  EXPECT_TRUE(MappingOf(h).Advised("hg")) << MappingOf(h).vm_flags;
  EXPECT_FALSE(MappingOf(q).Advised("hg")) << MappingOf(q).vm_flags;
  EXPECT_EQ(h[4 << 20], 0);
}

}  // namespace
}  // namespace shardcast
