// The NaN demonstration as a test: a heap-backed empty tensor can hand back what a freed tensor
// held (bf16 NaN here); a lazy-zero tensor never does.
#include "allocators/tensor_alloc.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <memory>

#include "allocators/memory_probe.h"

namespace shardcast {
namespace {

constexpr int64_t kElems = 16 * 1024;  // 32 KiB of bf16: below glibc's mmap threshold, a reused heap chunk

int64_t CountNonZero(const at::Tensor& t) { return (t.view(at::kShort) != 0).sum().item<int64_t>(); }

TEST(NanDemonstration, EmptyReturnsOldBytesLazyZeroNever) {
  int64_t garbage = 0, nans = 0;
  for (int i = 0; i < 4; ++i) {
    {
      at::Tensor a = at::empty({kElems}, at::kBFloat16);
      a.fill_(std::numeric_limits<float>::quiet_NaN());
    }
    at::Tensor b = at::empty({kElems}, at::kBFloat16);
    garbage = std::max(garbage, CountNonZero(b));
    nans = std::max(nans, b.isnan().sum().item<int64_t>());
  }
  // Which old bytes come back (the NaN pattern, or what temporaries wrote since) depends on heap state;
  // that something other than zeros does is the point.
  EXPECT_GT(garbage, 0) << "empty() after free returned clean memory (" << nans << " NaN)";
  for (int i = 0; i < 4; ++i) {
    {
      at::Tensor a = LazyZeroTensor({kElems}, at::kBFloat16);
      a.fill_(std::numeric_limits<float>::quiet_NaN());
    }
    at::Tensor b = LazyZeroTensor({kElems}, at::kBFloat16);
    ASSERT_EQ(CountNonZero(b), 0) << "lazy-zero must never return used memory";
    ASSERT_FALSE(b.isnan().any().item<bool>());
  }
}

TEST(LazyZeroTensor, IsLazyAndFreesOnLastReference) {
  uint64_t before = ReadMemory().rss_anon;
  at::Tensor t = LazyZeroTensor({1024, 1024, 64}, at::kBFloat16);  // 128 MiB
  EXPECT_EQ(t.numel(), 1024 * 1024 * 64);
  EXPECT_LT(ReadMemory().rss_anon, before + (16u << 20));
  EXPECT_EQ(LazyZeroStats().current_bytes >= 128u << 20, true);
  t.reset();
  EXPECT_LT(LazyZeroStats().current_bytes, 128u << 20);
  at::Tensor z = LazyZeroTensor({0, 5}, at::kFloat);
  EXPECT_EQ(z.numel(), 0);
}

// LazyZeroOwner finds the mapping under any range of a live lazy-zero tensor, keeps it mapped (and its
// bytes) after the tensor is gone, and finds nothing for other memory or once the last owner let go.
TEST(LazyZeroTensor, AnOwnerKeepsItsMappingAfterTheTensorIsGone) {
  at::Tensor t = LazyZeroTensor({4, 1 << 20}, at::kByte);  // 4 MiB
  auto* p = static_cast<unsigned char*>(t.data_ptr());
  EXPECT_EQ(LazyZeroOwner(p + (1 << 20), 1 << 20) != nullptr, true);
  EXPECT_EQ(LazyZeroOwner(p + (3 << 20), 2 << 20), nullptr) << "a range past its end";
  at::Tensor heap = at::ones({1 << 20}, at::kByte);
  EXPECT_EQ(LazyZeroOwner(heap.data_ptr(), 1 << 20), nullptr) << "memory of another allocator";
  std::shared_ptr<const void> owner = LazyZeroOwner(p, 4 << 20);
  ASSERT_NE(owner, nullptr);
  p[5] = 7;
  t.reset();
  EXPECT_EQ(p[5], 7) << "the owner did not keep the mapping";  // a fault here would be the bug
  p[(4 << 20) - 1] = 1;
  EXPECT_EQ(LazyZeroOwner(p, 1) != nullptr, true) << "an owner keeps it findable";
  owner.reset();
  EXPECT_EQ(LazyZeroOwner(p, 1), nullptr) << "the mapping outlived its last owner";
}

}  // namespace
}  // namespace shardcast
