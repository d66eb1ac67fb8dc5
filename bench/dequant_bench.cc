// Google Benchmark: the fp8 dequantization kernel against memcpy of its output, real time, decimal GB/s
// of output written.
//   BM_Dequant/<weight>x<scale>-><target>/<isa>  Dequantize of a 7168 x 2048 synthetic fp8 weight with its
//                                              128 x 128 scale grid (synth's values: realistic fp8, scales
//                                              log-uniform in [2^-14, 2^-6)), one thread
//   BM_MemcpyOutput/<bytes per element>        memcpy of the same number of output bytes, buffer to buffer
// Counters: GB/s (decimal, of output), memcpy_GB/s and x_memcpy (kernel speed / memcpy speed) from a
// memcpy of the output bytes inside every kernel iteration, untimed, and mismatches.
// Every kernel run also checks 4096 sampled outputs and the last row against a scalar reference
// (dtype.h's conversions, element by element): the "mismatches" counter must be 0.
// On a shared machine run with --benchmark_repetitions=5 and compare medians (or each case's fastest).
#include <benchmark/benchmark.h>

#include <chrono>
#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "loaders/quant/dequant.h"
#include "loaders/synth.h"

namespace shardcast {
namespace {

constexpr uint64_t kRows = 7168, kCols = 2048;
constexpr BlockSize kBlock{128, 128};
const std::string kKey = "model.layers.0.mlp.down_proj.weight";

uint32_t Bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

float ScaleAsFloat(DType d, const unsigned char* p) {
  uint16_t h;
  switch (d) {
    case DType::kF32: {
      float f;
      std::memcpy(&f, p, 4);
      return f;
    }
    case DType::kBF16: std::memcpy(&h, p, 2); return BFloat16BitsToFloat(h);
    case DType::kF16: std::memcpy(&h, p, 2); return HalfBitsToFloat(h);
    default: return Fp8E8M0BitsToFloat(*p);
  }
}

// The rule for one element, written out: decode, one fp32 product (a NaN scale wins), one rounding.
void Reference(DType wd, uint8_t w, float s, DType target, unsigned char* out) {
  const float x = wd == DType::kF8_E4M3 ? Fp8E4M3BitsToFloat(w) : Fp8E5M2BitsToFloat(w);
  float p = x * s;
  if (std::isnan(s)) {
    const uint32_t quiet = Bits(s) | 0x400000u;
    std::memcpy(&p, &quiet, 4);
  }
  const uint32_t u = Bits(p);
  uint16_t h;
  switch (target) {
    case DType::kF32: std::memcpy(out, &p, 4); return;
    case DType::kBF16: h = std::isnan(p) ? 0xFFFF : FloatToBFloat16Bits(p); break;
    default:
      h = std::isnan(p) ? static_cast<uint16_t>(((u >> 16) & 0x8000u) | 0x7E00u | ((u >> 13) & 0x3FFu))
                        : FloatToHalfBits(p);
  }
  std::memcpy(out, &h, 2);
}

struct Input {
  DType weight, scale;
  std::vector<unsigned char> w, s;
};

Input MakeInput(DType weight, DType scale) {
  const ScaleGrid g = ScaleGridFor(kRows, kCols, kBlock);
  Input in{weight, scale, std::vector<unsigned char>(kRows * kCols),
           std::vector<unsigned char>(g.rows * g.cols * DTypeSize(scale))};
  SynthElements(0, kKey, weight, 0, kRows * kCols, in.w.data());
  SynthElements(0, ScaleKeyFor(kKey), scale, 0, g.rows * g.cols, in.s.data());
  return in;
}

uint64_t CountMismatches(const Input& in, DType target, const std::vector<unsigned char>& out) {
  const size_t ts = DTypeSize(target), ss = DTypeSize(in.scale);
  const uint64_t gc = ScaleGridFor(kRows, kCols, kBlock).cols;
  std::mt19937_64 rng(1);
  uint64_t bad = 0;
  unsigned char want[4];
  auto check = [&](uint64_t i) {
    const uint64_t r = i / kCols, c = i % kCols;
    Reference(in.weight, in.w[i], ScaleAsFloat(in.scale, in.s.data() + ((r / kBlock.rows) * gc + c / kBlock.cols) * ss),
              target, want);
    bad += std::memcmp(want, out.data() + i * ts, ts) != 0;
  };
  for (int k = 0; k < 4096; ++k) check(rng() % (kRows * kCols));
  for (uint64_t i = (kRows - 1) * kCols; i < kRows * kCols; ++i) check(i);
  return bad;
}

void SetOutputRate(benchmark::State& state, uint64_t out_bytes) {
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * out_bytes));
  state.counters["GB/s"] = benchmark::Counter(out_bytes / 1e9, benchmark::Counter::kIsIterationInvariantRate);
}

using Clock = std::chrono::steady_clock;

// Each iteration also copies the same number of output bytes with memcpy, outside the timed region,
// so that "x_memcpy" (memcpy time / kernel time, iteration by iteration) is a paired ratio that a
// busy shared machine disturbs less than two separate benchmarks.
void BM_Dequant(benchmark::State& state, DType weight, DType scale, DType target, dequant_internal::Isa isa) {
  const Input in = MakeInput(weight, scale);
  const uint64_t out_bytes = kRows * kCols * DTypeSize(target);
  std::vector<unsigned char> out(out_bytes), copy_src(out_bytes, 1), copy_dst(out_bytes, 0);
  const DequantScale s{scale, in.s.data(), ScaleGridFor(kRows, kCols, kBlock).cols};
  double kernel_s = 0, memcpy_s = 0;
  for (auto _ : state) {
    const auto t0 = Clock::now();
    dequant_internal::DequantizeWithIsa(isa, {weight, in.w.data()}, s, {0, kRows}, kCols, kBlock, target, out.data());
    benchmark::DoNotOptimize(out.data());
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
  state.counters["mismatches"] = static_cast<double>(CountMismatches(in, target, out));
}

void BM_MemcpyOutput(benchmark::State& state) {
  const uint64_t out_bytes = kRows * kCols * static_cast<uint64_t>(state.range(0));
  std::vector<unsigned char> src(out_bytes, 1), dst(out_bytes, 0);
  for (auto _ : state) {
    std::memcpy(dst.data(), src.data(), out_bytes);
    benchmark::DoNotOptimize(dst.data());
    benchmark::ClobberMemory();
  }
  SetOutputRate(state, out_bytes);
  state.counters["mismatches"] = static_cast<double>(std::memcmp(src.data(), dst.data(), out_bytes) != 0);
}

std::string Short(DType d) {
  std::string n(DTypeName(d));
  return n.rfind("F8_", 0) == 0 ? n.substr(3) : n;
}

void Register() {
  using dequant_internal::Isa;
  const Isa best = dequant_internal::SupportedIsas().back();
  auto add = [](DType w, DType s, DType t, Isa isa) {
    const std::string name = "BM_Dequant/" + Short(w) + "x" + Short(s) + "->" + Short(t) + "/" +
                             std::string(dequant_internal::IsaName(isa));
    benchmark::RegisterBenchmark(name.c_str(), BM_Dequant, w, s, t, isa)
        ->Unit(benchmark::kMillisecond)->UseRealTime()->MinTime(1);
  };
  benchmark::RegisterBenchmark("BM_MemcpyOutput", BM_MemcpyOutput)
      ->Arg(2)->Arg(4)->Unit(benchmark::kMillisecond)->UseRealTime()->MinTime(1);
  // The DeepSeek-V3 / MiniMax-M2 case on every ISA this CPU has, then the other dtypes on the best.
  for (Isa isa : dequant_internal::SupportedIsas()) add(DType::kF8_E4M3, DType::kF32, DType::kBF16, isa);
  for (DType s : {DType::kBF16, DType::kF16, DType::kF8_E8M0}) add(DType::kF8_E4M3, s, DType::kBF16, best);
  for (DType t : {DType::kF16, DType::kF32}) add(DType::kF8_E4M3, DType::kF32, t, best);
  add(DType::kF8_E5M2, DType::kF32, DType::kBF16, best);
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
