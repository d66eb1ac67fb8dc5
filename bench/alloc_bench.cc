// Google Benchmark: what getting 1 GiB costs under each strategy, in real time.
//   BM_AllocateAndTouch/<strategy>  allocate, then write one byte per 4 KiB page (first touch)
//   BM_ZeroedMemory/lazy-zero       allocate and fault every page in: zeroed by the kernel, once
//   BM_ZeroedMemory/empty+memset    at::empty, then memset(0): what zeros-like does
// Each checks its bytes after the timing. GB/s is decimal, over the 1 GiB.
#include <ATen/ATen.h>
#include <benchmark/benchmark.h>

#include <cstring>

#include "allocators/tensor_alloc.h"

namespace shardcast {
namespace {

constexpr int64_t kBytes = 1ll << 30;

void TouchPages(unsigned char* p, int64_t n) {
  for (int64_t i = 0; i < n; i += 4096) p[i] = 1;
}

void Rate(benchmark::State& state) {
  state.counters["GB/s"] = benchmark::Counter(kBytes / 1e9, benchmark::Counter::kIsIterationInvariantRate);
}

void BM_AllocateAndTouch_ZerosLike(benchmark::State& state) {
  unsigned char last = 0;
  for (auto _ : state) {
    at::Tensor t = at::zeros({kBytes}, at::kByte);
    TouchPages(t.data_ptr<unsigned char>(), kBytes);
    last = t.data_ptr<unsigned char>()[4097];
  }
  if (last != 0) state.SkipWithError("zeros-like byte not zero");
  Rate(state);
}

void BM_AllocateAndTouch_EmptyLike(benchmark::State& state) {
  for (auto _ : state) {
    at::Tensor t = at::empty({kBytes}, at::kByte);
    TouchPages(t.data_ptr<unsigned char>(), kBytes);
    benchmark::DoNotOptimize(t.data_ptr());
  }
  Rate(state);
}

void BM_AllocateAndTouch_LazyZero(benchmark::State& state) {
  unsigned char last = 1;
  for (auto _ : state) {
    at::Tensor t = LazyZeroTensor({kBytes}, at::kByte, LazyZeroOptions{state.range(0) != 0});
    last = t.data_ptr<unsigned char>()[4097];  // untouched byte of a touched page
    TouchPages(t.data_ptr<unsigned char>(), kBytes);
  }
  if (last != 0) state.SkipWithError("lazy-zero byte not zero");
  Rate(state);
}

void BM_AllocateAndTouch_Meta(benchmark::State& state) {
  for (auto _ : state) {
    at::Tensor t = at::empty({kBytes}, at::TensorOptions().dtype(at::kByte).device(at::kMeta));
    benchmark::DoNotOptimize(t.numel());
  }
}

void BM_ZeroedMemory_LazyZero(benchmark::State& state) {
  uint64_t sum = 1;
  for (auto _ : state) {
    at::Tensor t = LazyZeroTensor({kBytes}, at::kByte);
    auto* p = t.data_ptr<unsigned char>();
    for (int64_t i = 0; i < kBytes; i += 4096) p[i] = 0;  // fault each page in: the kernel zeroes it
    sum = p[kBytes - 1] + p[12345];
  }
  if (sum != 0) state.SkipWithError("not zero");
  Rate(state);
}

void BM_ZeroedMemory_EmptyPlusMemset(benchmark::State& state) {
  uint64_t sum = 1;
  for (auto _ : state) {
    at::Tensor t = at::empty({kBytes}, at::kByte);
    std::memset(t.data_ptr(), 0, kBytes);
    sum = t.data_ptr<unsigned char>()[kBytes - 1] + t.data_ptr<unsigned char>()[12345];
  }
  if (sum != 0) state.SkipWithError("not zero");
  Rate(state);
}

BENCHMARK(BM_AllocateAndTouch_ZerosLike)->Name("BM_AllocateAndTouch/zeros-like")->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_AllocateAndTouch_EmptyLike)->Name("BM_AllocateAndTouch/empty-like")->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_AllocateAndTouch_LazyZero)->Name("BM_AllocateAndTouch/lazy-zero")->Arg(0)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_AllocateAndTouch_LazyZero)->Name("BM_AllocateAndTouch/lazy-zero-hugepages")->Arg(1)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_AllocateAndTouch_Meta)->Name("BM_AllocateAndTouch/meta")->Unit(benchmark::kMicrosecond)->UseRealTime();
BENCHMARK(BM_ZeroedMemory_LazyZero)->Name("BM_ZeroedMemory/lazy-zero")->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_ZeroedMemory_EmptyPlusMemset)->Name("BM_ZeroedMemory/empty+memset")->Unit(benchmark::kMillisecond)->UseRealTime();

}  // namespace
}  // namespace shardcast

BENCHMARK_MAIN();
