// Google Benchmark: the FP4 kernels (MXFP4, NVFP4) against memcpy of their output, real time, decimal
// GB/s of output.
//   BM_Mxfp4/<layout>-><target>/<isa>   one gpt-oss-120b gate_up_proj expert: stored [5760, 2880]
//                                       (out x in), written as the model's transpose [2880, 5760]
//                                       ("transposed") or as stored ("stored"); random bytes, scales
//                                       in gpt-oss's range [112, 132), one thread
//   BM_Nvfp4/-><target>/<isa>           a ModelOpt NVFP4 linear of the same size, [5760, 2880] as stored;
//                                       random bytes, E4M3 block scales 0x20-0x5f, global scale 1/2688
//   BM_Nvfp4Windows/16x64-><target>/<isa>  the same, one call per window of 16 rows x 64 columns (as
//                                       tensor-parallel cuts call it): the per-call cost
// Counters as in dequant_bench: GB/s (of output), memcpy_GB/s and x_memcpy (memcpy time / kernel time,
// paired per iteration, the memcpy untimed), and mismatches: 4096 sampled outputs and the first output
// row against the rule written out (E2M1 by its bits, times 2^(scale - 127) in double, one rounding;
// NVFP4: E4M3 by its bits times the global scale rounded to f32, E2M1 times that rounded to f32, then
// the target's rounding).
// On a shared machine run with --benchmark_repetitions=5 and compare medians.
#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "loaders/quant/mxfp4.h"
#include "loaders/quant/nvfp4.h"

namespace shardcast {
namespace {

using mxfp4_internal::Layout;
constexpr uint64_t kOut = 5760, kIn = 2880;  // gpt-oss-120b: 2 x intermediate 2880, hidden 2880

struct Input {
  std::vector<uint8_t> blocks = std::vector<uint8_t>(kOut * kIn / 2);
  std::vector<uint8_t> scales = std::vector<uint8_t>(kOut * kIn / 32);
  Input() {
    std::mt19937 rng(5);
    for (auto& b : blocks) b = static_cast<uint8_t>(rng());
    for (auto& s : scales) s = static_cast<uint8_t>(112 + rng() % 20);
  }
  Mxfp4Matrix Matrix() const { return {blocks.data(), scales.data(), 0, kIn}; }
};

uint32_t Reference(const Input& in, uint64_t o, uint64_t i, DType target) {
  const uint8_t b = in.blocks[o * kIn / 2 + i / 2], nib = i % 2 ? b >> 4 : b & 0x0F;
  const int e = (nib >> 1) & 3, m = nib & 1;
  const double mag = e == 0 ? 0.5 * m : std::ldexp(1.0 + 0.5 * m, e - 1);
  const float f = static_cast<float>(std::ldexp(nib & 8 ? -mag : mag, in.scales[o * kIn / 32 + i / 32] - 127));
  if (target == DType::kBF16) return FloatToBFloat16Bits(f);
  if (target == DType::kF16) return FloatToHalfBits(f);
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

uint64_t CountMismatches(const Input& in, Layout layout, DType target, const std::vector<unsigned char>& out) {
  const size_t ts = DTypeSize(target);
  const uint64_t cols = layout == Layout::kStored ? kIn : kOut;
  std::mt19937_64 rng(1);
  uint64_t bad = 0;
  auto check = [&](uint64_t k) {
    const uint64_t r = k / cols, c = k % cols;
    const uint32_t want = layout == Layout::kStored ? Reference(in, r, c, target) : Reference(in, c, r, target);
    uint32_t got = 0;
    std::memcpy(&got, out.data() + k * ts, ts);
    bad += got != want;
  };
  for (int k = 0; k < 4096; ++k) check(rng() % (kOut * kIn));
  for (uint64_t k = 0; k < cols; ++k) check(k);
  return bad;
}

using Clock = std::chrono::steady_clock;

void SetOutputRate(benchmark::State& state, uint64_t out_bytes) {
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * out_bytes));
  state.counters["GB/s"] = benchmark::Counter(out_bytes / 1e9, benchmark::Counter::kIsIterationInvariantRate);
}

// Times run() against a memcpy of the same output bytes in every iteration (the memcpy untimed).
template <typename Run>
void TimeAgainstMemcpy(benchmark::State& state, uint64_t out_bytes, Run&& run) {
  std::vector<unsigned char> copy_src(out_bytes, 1), copy_dst(out_bytes, 0);
  double kernel_s = 0, memcpy_s = 0;
  for (auto _ : state) {
    const auto t0 = Clock::now();
    run();
    benchmark::ClobberMemory();
    const auto t1 = Clock::now();
    state.PauseTiming();
    const auto t2 = Clock::now();
    std::memcpy(copy_dst.data(), copy_src.data(), out_bytes);
    benchmark::DoNotOptimize(copy_dst.data());
    benchmark::ClobberMemory();
    memcpy_s += std::chrono::duration<double>(Clock::now() - t2).count();
    kernel_s += std::chrono::duration<double>(t1 - t0).count();
    state.ResumeTiming();
  }
  SetOutputRate(state, out_bytes);
  state.counters["memcpy_GB/s"] = static_cast<double>(state.iterations()) * out_bytes / memcpy_s / 1e9;
  state.counters["x_memcpy"] = memcpy_s / kernel_s;
}

void BM_Mxfp4(benchmark::State& state, Layout layout, DType target, dequant_internal::Isa isa) {
  const Input in;
  const uint64_t out_bytes = kOut * kIn * DTypeSize(target);
  std::vector<unsigned char> out(out_bytes);
  const OutputWindow w = layout == Layout::kStored ? OutputWindow{{0, kOut}, {0, kIn}} : OutputWindow{{0, kIn}, {0, kOut}};
  TimeAgainstMemcpy(state, out_bytes, [&] {
    mxfp4_internal::DequantizeWithIsa(isa, in.Matrix(), w, target, WindowOut{out.data()}, layout);
    benchmark::DoNotOptimize(out.data());
  });
  state.counters["mismatches"] = static_cast<double>(CountMismatches(in, layout, target, out));
}

struct Nvfp4Input {
  static constexpr float kGlobal = 1.0f / 2688;  // amax / (6 x 448), a checkpoint's typical order
  std::vector<uint8_t> values = std::vector<uint8_t>(kOut * kIn / 2);
  std::vector<uint8_t> scales = std::vector<uint8_t>(kOut * kIn / 16);
  Nvfp4Input() {
    std::mt19937 rng(7);
    for (auto& b : values) b = static_cast<uint8_t>(rng());
    for (auto& s : scales) s = static_cast<uint8_t>(0x20 + rng() % 0x40);
  }
  Nvfp4Matrix Matrix() const { return {values.data(), scales.data(), kGlobal, 0, kIn}; }
};

uint32_t Nvfp4Reference(const Nvfp4Input& in, uint64_t o, uint64_t i, DType target) {
  const uint8_t b = in.values[o * kIn / 2 + i / 2], nib = i % 2 ? b >> 4 : b & 0x0F;
  const int e = (nib >> 1) & 3, m = nib & 1;
  const double mag = e == 0 ? 0.5 * m : std::ldexp(1.0 + 0.5 * m, e - 1);
  const uint8_t sc = in.scales[o * kIn / 16 + i / 16];
  const int se = (sc >> 3) & 0xF, sm = sc & 7;  // E4M3, bias 7; the scales here are positive and finite
  const double scale = se == 0 ? std::ldexp(sm / 8.0, -6) : std::ldexp(1.0 + sm / 8.0, se - 7);
  const float s = static_cast<float>(scale * static_cast<double>(Nvfp4Input::kGlobal));
  const float f = static_cast<float>((nib & 8 ? -mag : mag) * static_cast<double>(s));
  if (target == DType::kBF16) return FloatToBFloat16Bits(f);
  if (target == DType::kF16) return FloatToHalfBits(f);
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

// 4096 sampled outputs and the first row of [kOut, kIn] against the rule.
uint64_t CountNvfp4Mismatches(const Nvfp4Input& in, DType target, const std::vector<unsigned char>& out) {
  const size_t ts = DTypeSize(target);
  std::mt19937_64 rng(1);
  uint64_t bad = 0;
  auto check = [&](uint64_t k) {
    uint32_t got = 0;
    std::memcpy(&got, out.data() + k * ts, ts);
    bad += got != Nvfp4Reference(in, k / kIn, k % kIn, target);
  };
  for (int k = 0; k < 4096; ++k) check(rng() % (kOut * kIn));
  for (uint64_t k = 0; k < kIn; ++k) check(k);
  return bad;
}

void BM_Nvfp4(benchmark::State& state, DType target, dequant_internal::Isa isa) {
  const Nvfp4Input in;
  const size_t ts = DTypeSize(target);
  const uint64_t out_bytes = kOut * kIn * ts;
  std::vector<unsigned char> out(out_bytes);
  TimeAgainstMemcpy(state, out_bytes, [&] {
    nvfp4_internal::DequantizeWithIsa(isa, in.Matrix(), OutputWindow{{0, kOut}, {0, kIn}}, target,
                                      WindowOut{out.data()});
    benchmark::DoNotOptimize(out.data());
  });
  state.counters["mismatches"] = static_cast<double>(CountNvfp4Mismatches(in, target, out));
}

// The same matrix as windows of 16 rows x 64 columns, one call each, as tensor-parallel cuts call the
// kernel (runtime/manifest/quant_parts.cc): the per-call cost (its scale tables) against the work.
constexpr uint64_t kWindowRows = 16, kWindowCols = 64;

void BM_Nvfp4Windows(benchmark::State& state, DType target, dequant_internal::Isa isa) {
  const Nvfp4Input in;
  const size_t ts = DTypeSize(target);
  const uint64_t out_bytes = kOut * kIn * ts;
  std::vector<unsigned char> out(out_bytes);
  TimeAgainstMemcpy(state, out_bytes, [&] {
    for (uint64_t r = 0; r < kOut; r += kWindowRows) {
      for (uint64_t c = 0; c < kIn; c += kWindowCols) {
        const OutputWindow w{{r, std::min(kOut, r + kWindowRows)}, {c, std::min(kIn, c + kWindowCols)}};
        nvfp4_internal::DequantizeWithIsa(isa, in.Matrix(), w, target, WindowOut{out.data() + (r * kIn + c) * ts, kIn});
      }
    }
    benchmark::DoNotOptimize(out.data());
  });
  state.counters["mismatches"] = static_cast<double>(CountNvfp4Mismatches(in, target, out));
}

void Register() {
  using dequant_internal::Isa;
  const Isa best = dequant_internal::SupportedIsas().back();
  auto add = [](Layout layout, DType t, Isa isa) {
    const std::string name = std::string("BM_Mxfp4/") + (layout == Layout::kStored ? "stored" : "transposed") +
                             "->" + std::string(DTypeName(t)) + "/" + std::string(dequant_internal::IsaName(isa));
    benchmark::RegisterBenchmark(name.c_str(), BM_Mxfp4, layout, t, isa)
        ->Unit(benchmark::kMillisecond)->UseRealTime()->MinTime(1);
  };
  // gpt-oss's case (the model's transpose, BF16) on every ISA, then the other targets and the stored layout.
  for (Isa isa : dequant_internal::SupportedIsas()) add(Layout::kTransposed, DType::kBF16, isa);
  for (DType t : {DType::kF16, DType::kF32}) add(Layout::kTransposed, t, best);
  add(Layout::kStored, DType::kBF16, best);
  for (Isa isa : dequant_internal::SupportedIsas()) {
    for (DType t : {DType::kBF16, DType::kF16, DType::kF32}) {
      const std::string name =
          "BM_Nvfp4/->" + std::string(DTypeName(t)) + "/" + std::string(dequant_internal::IsaName(isa));
      benchmark::RegisterBenchmark(name.c_str(), BM_Nvfp4, t, isa)->Unit(benchmark::kMillisecond)->UseRealTime()
          ->MinTime(1);
    }
  }
  for (Isa isa : dequant_internal::SupportedIsas()) {
    for (DType t : {DType::kBF16, DType::kF16, DType::kF32}) {
      const std::string name = "BM_Nvfp4Windows/16x64->" + std::string(DTypeName(t)) + "/" +
                               std::string(dequant_internal::IsaName(isa));
      benchmark::RegisterBenchmark(name.c_str(), BM_Nvfp4Windows, t, isa)->Unit(benchmark::kMillisecond)
          ->UseRealTime()->MinTime(1);
    }
  }
}

}  // namespace
}  // namespace shardcast

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  shardcast::Register();
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
