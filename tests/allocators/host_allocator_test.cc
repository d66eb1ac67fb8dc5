#include "allocators/host_allocator.h"

#include <dlfcn.h>
#include <gtest/gtest.h>

#include <cstdlib>
#include <vector>

#include "allocators/pinned.h"
#include "tests/loaders/test_util.h"

namespace shardcast {
namespace {

TEST(HostAllocator, AllocatesFromMimallocWithStats) {
  HostAllocator& a = HostAllocator::Get();
  EXPECT_NE(a.backend().find("mimalloc"), std::string::npos);
  AllocatorStats s0 = a.stats();
  void* p = a.Allocate(100000);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(p) % 16, 0u);
  AllocatorStats s1 = a.stats();
  EXPECT_GE(s1.current_bytes - s0.current_bytes, 100000u);
  EXPECT_GE(s1.peak_bytes, s1.current_bytes);
  a.Free(p);
  EXPECT_EQ(a.stats().current_bytes, s0.current_bytes);
  EXPECT_GE(a.stats().total_bytes - s0.total_bytes, 100000u);
  std::vector<int, HostStlAllocator<int>> v(1000, 7);
  EXPECT_EQ(v[999], 7);
}

// mimalloc serves our calls only: the process's malloc stays libc's, so torch's CPU allocations
// (and what the RSS benchmark measures of them) are what users get.
TEST(HostAllocator, DoesNotReplaceProcessMalloc) {
  HostAllocator::Get();
  void* mi = dlopen("libmimalloc.so.2", RTLD_NOW | RTLD_NOLOAD);  // loaded, privately
  ASSERT_NE(mi, nullptr);
  void* mi_malloc = dlsym(mi, "malloc");  // this mimalloc build exports malloc: what must not win
  ASSERT_NE(mi_malloc, nullptr);
  EXPECT_NE(dlsym(RTLD_DEFAULT, "malloc"), mi_malloc);  // libc's, or ASan's in the sanitizer build
  dlclose(mi);
}

TEST(Pinned, ClearErrorWithoutCudaOrWithoutDevice) {
  try {
    PinnedBuffer b = PinnedBuffer::Allocate(1 << 20);
    EXPECT_TRUE(PinnedAvailableInBuild());
    EXPECT_NE(b.data(), nullptr);  // a GPU machine
    EXPECT_EQ(PinnedStats().current_bytes, 1u << 20);
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kUnsupported) << e.what();
    std::string msg = e.what();
    if (!PinnedAvailableInBuild()) {
      EXPECT_NE(msg.find("unavailable in this build"), std::string::npos) << msg;
    } else {
      EXPECT_NE(msg.find("cudaHostAlloc of 1048576 bytes failed"), std::string::npos) << msg;
    }
  }
}

}  // namespace
}  // namespace shardcast
