#include "loaders/quant/dequant.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "allocators/error.h"
#include "loaders/shape.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <cpuid.h>
#include <immintrin.h>
#endif

// How the kernel is fast without a per-element switch:
//   - the scales of a block row are decoded once into one float per column, so a row is a single
//     loop `out[c] = round(decode(w[c]) * s[c])` whatever the block width;
//   - one row kernel per (weight dtype, target, RowMode), picked per block row from what its scales
//     allow (RowMode below); real checkpoints take kScaledBits, one multiply and no decode;
//   - decode and rounding are branch-free integer and float code the compiler vectorizes. Each row
//     kernel is compiled for the baseline, AVX2 and AVX-512, and Dequantize runs the best the CPU has;
//     only F16 targets use an intrinsic there (F16C's vcvtps2ph, which rounds exactly like ToF16).
//     The file is compiled with -ffp-contract=off, so every build does the same IEEE operations in the
//     same order: the same bits on every CPU (tests/loaders/dequant_test.cc checks each ISA).
//
//   weight rows [r0, r1), bh = 4, cols = 10, bw = 4        expanded scale row for grid row g
//   r0 = 6 -> +----+----+--+  grid row 1                  s[g][0] x4 | s[g][1] x4 | s[g][2] x2
//        7    |    |    |  |
//        8 -> +----+----+--+  grid row 2 (decode again)
//        9    |    |    |  |

namespace shardcast {
namespace {

#define SHARDCAST_INLINE inline __attribute__((always_inline))

SHARDCAST_INLINE uint32_t Bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
SHARDCAST_INLINE float Float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
SHARDCAST_INLINE bool IsNanBits(uint32_t u) { return static_cast<int32_t>(u & 0x7FFFFFFFu) > 0x7F800000; }

// e4m3fn: normals move exponent and mantissa into place and rebias by 127 - 7; subnormals are
// m * 2^-9 (exact as float(m) * 2^-9, no denormal float involved); 0x7F is NaN. = Fp8E4M3BitsToFloat.
SHARDCAST_INLINE float DecodeE4M3(uint8_t b) {
  const uint32_t x = b, sign = (x & 0x80u) << 24, em = x & 0x7Fu;
  const uint32_t normal = (em << 20) + (120u << 23);
  const uint32_t sub = Bits(static_cast<float>(static_cast<int32_t>(em)) * 0x1p-9f);
  uint32_t mag = em < 8 ? sub : normal;
  mag = em == 0x7F ? 0x7FF00000u : mag;
  return Float(sign | mag);
}

// e5m2, the top byte of a half: rebias by 127 - 15; subnormals m * 2^-16; exponent 31 is inf (m = 0)
// or NaN, quieted with its payload. = Fp8E5M2BitsToFloat.
SHARDCAST_INLINE float DecodeE5M2(uint8_t b) {
  const uint32_t x = b, sign = (x & 0x80u) << 24, em = x & 0x7Fu;
  const uint32_t normal = (em << 21) + (112u << 23);
  const uint32_t sub = Bits(static_cast<float>(static_cast<int32_t>(em)) * 0x1p-16f);
  const uint32_t quiet = ((em + 3u) & 0x80u) << 15;  // 0x400000 for em > 0x7C, the NaNs
  const uint32_t special = 0x7F800000u | ((em & 3u) << 21) | quiet;
  uint32_t mag = em < 4 ? sub : normal;
  mag = em >= 0x7C ? special : mag;
  return Float(sign | mag);
}

// torch's CPU float -> bf16: round to nearest even on the bits (denormals too); every NaN is 0xFFFF.
SHARDCAST_INLINE uint16_t ToBF16(float p) {
  const uint32_t u = Bits(p);
  const uint32_t r = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  return static_cast<uint16_t>(IsNanBits(u) ? 0xFFFFu : r);
}

// float -> IEEE half, round to nearest even, by c10's method (FloatToHalfBits in dtype.cc); a NaN
// keeps its sign and the top 10 bits of its payload and is quieted, as vcvtps2ph (torch) does.
SHARDCAST_INLINE uint16_t ToF16(float f) {
  const uint32_t w = Bits(f);
  const float base0 = (Float(w & 0x7FFFFFFFu) * 0x1p112f) * 0x1p-110f;
  const uint32_t shl1_w = w + w;
  const uint32_t sign = w & 0x80000000u;
  uint32_t bias = shl1_w & 0xFF000000u;
  bias = bias < 0x71000000u ? 0x71000000u : bias;
  const uint32_t bits = Bits(Float((bias >> 1) + 0x07800000u) + base0);
  const uint32_t nonsign = ((bits >> 13) & 0x7C00u) + (bits & 0x0FFFu);
  const uint32_t nan = 0x7E00u | ((w >> 13) & 0x3FFu);
  return static_cast<uint16_t>((sign >> 16) | (shl1_w > 0xFF000000u ? nan : nonsign));
}

template <DType kWeight>
SHARDCAST_INLINE float Decode(uint8_t b) {
  if constexpr (kWeight == DType::kF8_E4M3) return DecodeE4M3(b);
  else return DecodeE5M2(b);
}

template <DType kTarget>
SHARDCAST_INLINE void Store(unsigned char* out, uint64_t i, float p) {
  if constexpr (kTarget == DType::kF32) {
    std::memcpy(out + 4 * i, &p, 4);
  } else {
    const uint16_t h = kTarget == DType::kBF16 ? ToBF16(p) : ToF16(p);
    std::memcpy(out + 2 * i, &h, 2);
  }
}

// How a block row's scales let a row be computed (ExpandScaleRow decides):
//   kPlain       round(decode(w) * s), the rule as written.
//   kNanScales   some s is NaN: such a column gives quiet(s) even where w is NaN too (torch's product
//                keeps its second operand's payload); a plain product would leave that to the compiler's
//                choice of operand order.
//   kScaledBits  E4M3 only, every |s| < 2^8, no DAZ: the weight's bits shifted into a float are
//                w * 2^-120 exactly (subnormals land on float denormals), and the expanded scales hold
//                s * 2^120 exactly, so one multiply rounds the same real product w * s. No lane can be
//                NaN but the NaN weights (0x7F, 0xFF), which get their bits from a byte test.
enum class RowMode { kPlain, kNanScales, kScaledBits };
constexpr float kScaledBitsFactor = 0x1p120f;
constexpr float kScaledBitsLimit = 0x1p8f;  // |s| < 2^8 keeps s * 2^120 finite

// float -> bf16 for a value known not to be NaN.
SHARDCAST_INLINE uint16_t ToBF16NotNan(float p) {
  const uint32_t u = Bits(p);
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

template <DType kTarget>
SHARDCAST_INLINE void StoreScaledBits(unsigned char* out, uint64_t i, float p, uint32_t x) {
  const bool nan = (x & 0x7Fu) == 0x7Fu;
  const uint32_t sign = (x & 0x80u) << 24;
  if constexpr (kTarget == DType::kF32) {
    const uint32_t v = nan ? sign | 0x7FF00000u : Bits(p);
    std::memcpy(out + 4 * i, &v, 4);
  } else if constexpr (kTarget == DType::kBF16) {
    const uint16_t h = nan ? 0xFFFF : ToBF16NotNan(p);
    std::memcpy(out + 2 * i, &h, 2);
  } else {
    const uint16_t h = nan ? static_cast<uint16_t>((sign >> 16) | 0x7F80u) : ToF16(p);
    std::memcpy(out + 2 * i, &h, 2);
  }
}

// One weight row: out[i] for i < n from w[i] and s[i], the row's scales expanded to one per column.
template <DType kWeight, DType kTarget, RowMode kMode>
SHARDCAST_INLINE void RowBody(const uint8_t* __restrict__ w, const float* __restrict__ s, uint64_t n,
                              unsigned char* __restrict__ out) {
  for (uint64_t i = 0; i < n; ++i) {
    if constexpr (kMode == RowMode::kScaledBits) {
      static_assert(kWeight == DType::kF8_E4M3, "the scaled-bits path is E4M3's");
      const uint32_t x = w[i];
      const float p = Float(((x << 24) & 0x80000000u) | ((x & 0x7Fu) << 20)) * s[i];
      StoreScaledBits<kTarget>(out, i, p, x);
    } else {
      float p = Decode<kWeight>(w[i]) * s[i];
      if constexpr (kMode == RowMode::kNanScales) {
        const uint32_t sb = Bits(s[i]);
        p = IsNanBits(sb) ? Float(sb | 0x400000u) : p;
      }
      Store<kTarget>(out, i, p);
    }
  }
}

using RowFn = void (*)(const uint8_t*, const float*, uint64_t, unsigned char*);

// The same row kernels compiled for each ISA level. The baseline is plain x86-64 (SSE2) or whatever
// the build targets; the others exist on x86-64 with GCC or clang and are used where the CPU has them.
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define SHARDCAST_DEQUANT_X86 1
#define SHARDCAST_TARGET_AVX2 __attribute__((target("avx2,bmi,bmi2,f16c")))
#define SHARDCAST_TARGET_AVX512 __attribute__((target("avx2,bmi,bmi2,f16c,avx512f,avx512bw,avx512vl,avx512dq")))
#else
#define SHARDCAST_DEQUANT_X86 0
#define SHARDCAST_TARGET_AVX2
#define SHARDCAST_TARGET_AVX512
#endif

struct BaselineIsa {
  template <DType kWeight, DType kTarget, RowMode kMode>
  static void Row(const uint8_t* __restrict__ w, const float* __restrict__ s, uint64_t n,
                  unsigned char* __restrict__ out) {
    RowBody<kWeight, kTarget, kMode>(w, s, n, out);
  }
};
// F16 targets with F16C: the row to F32 first (the bits an F32 target gets), then vcvtps2ph, whose
// rounding (nearest even) and NaN rule (quieted, the payload's top 10 bits kept) are ToF16's, in one
// instruction instead of ToF16's twenty. `convert` converts a prefix of a chunk, returning its length.
template <DType kWeight, RowMode kMode, class Convert>
SHARDCAST_INLINE void RowToF16ViaF32(const uint8_t* __restrict__ w, const float* __restrict__ s, uint64_t n,
                                     unsigned char* __restrict__ out, Convert convert) {
  constexpr uint64_t kChunk = 512;  // 2 KiB of floats, in L1
  alignas(64) float f32[kChunk];
  for (uint64_t c0 = 0; c0 < n; c0 += kChunk) {
    const uint64_t m = std::min(kChunk, n - c0);
    RowBody<kWeight, DType::kF32, kMode>(w + c0, s + c0, m, reinterpret_cast<unsigned char*>(f32));
    unsigned char* o = out + 2 * c0;
    for (uint64_t i = convert(f32, m, o); i < m; ++i) {
      const uint16_t h = ToF16(f32[i]);
      std::memcpy(o + 2 * i, &h, 2);
    }
  }
}

#if SHARDCAST_DEQUANT_X86
constexpr int kNearestEven = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;

SHARDCAST_TARGET_AVX2 uint64_t F32ToF16Avx2(const float* f32, uint64_t m, unsigned char* o) {
  uint64_t i = 0;
  for (; i + 8 <= m; i += 8) {
    const __m128i h = _mm256_cvtps_ph(_mm256_loadu_ps(f32 + i), kNearestEven);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(o + 2 * i), h);
  }
  return i;
}

SHARDCAST_TARGET_AVX512 uint64_t F32ToF16Avx512(const float* f32, uint64_t m, unsigned char* o) {
  uint64_t i = 0;
  for (; i + 16 <= m; i += 16) {
    const __m256i h = _mm512_maskz_cvtps_ph(0xFFFF, _mm512_loadu_ps(f32 + i), kNearestEven);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + 2 * i), h);
  }
  return i;
}
#endif

struct Avx2Isa {
  template <DType kWeight, DType kTarget, RowMode kMode>
  SHARDCAST_TARGET_AVX2 static void Row(const uint8_t* __restrict__ w, const float* __restrict__ s, uint64_t n,
                                        unsigned char* __restrict__ out) {
#if SHARDCAST_DEQUANT_X86
    if constexpr (kTarget == DType::kF16) return RowToF16ViaF32<kWeight, kMode>(w, s, n, out, F32ToF16Avx2);
#endif
    RowBody<kWeight, kTarget, kMode>(w, s, n, out);
  }
};
struct Avx512Isa {
  template <DType kWeight, DType kTarget, RowMode kMode>
  SHARDCAST_TARGET_AVX512 static void Row(const uint8_t* __restrict__ w, const float* __restrict__ s, uint64_t n,
                                          unsigned char* __restrict__ out) {
#if SHARDCAST_DEQUANT_X86
    if constexpr (kTarget == DType::kF16) return RowToF16ViaF32<kWeight, kMode>(w, s, n, out, F32ToF16Avx512);
#endif
    RowBody<kWeight, kTarget, kMode>(w, s, n, out);
  }
};

// kernels[weight is E5M2][mode][target: BF16, F16, F32]; E5M2 has no kScaledBits (nullptr).
using RowKernels = std::array<std::array<std::array<RowFn, 3>, 3>, 2>;

template <class Isa, DType kWeight, RowMode kMode>
constexpr std::array<RowFn, 3> TargetRow() {
  if constexpr (kWeight == DType::kF8_E5M2 && kMode == RowMode::kScaledBits) {
    return {nullptr, nullptr, nullptr};
  } else {
    return {&Isa::template Row<kWeight, DType::kBF16, kMode>, &Isa::template Row<kWeight, DType::kF16, kMode>,
            &Isa::template Row<kWeight, DType::kF32, kMode>};
  }
}

template <class Isa, DType kWeight>
constexpr std::array<std::array<RowFn, 3>, 3> ModeRow() {
  return {TargetRow<Isa, kWeight, RowMode::kPlain>(), TargetRow<Isa, kWeight, RowMode::kNanScales>(),
          TargetRow<Isa, kWeight, RowMode::kScaledBits>()};
}

template <class Isa>
constexpr RowKernels KernelsFor() {
  return {ModeRow<Isa, DType::kF8_E4M3>(), ModeRow<Isa, DType::kF8_E5M2>()};
}

const RowKernels& KernelsOf(dequant_internal::Isa isa) {
  static constexpr RowKernels kBaseline = KernelsFor<BaselineIsa>();
#if SHARDCAST_DEQUANT_X86
  static constexpr RowKernels kAvx2 = KernelsFor<Avx2Isa>();
  static constexpr RowKernels kAvx512 = KernelsFor<Avx512Isa>();
  if (isa == dequant_internal::Isa::kAvx2) return kAvx2;
  if (isa == dequant_internal::Isa::kAvx512) return kAvx512;
#endif
  return kBaseline;
}

// Whether denormal inputs are read as zero (MXCSR.DAZ): the scaled-bits path needs them read as they are.
bool DenormalsAreZero() {
#if SHARDCAST_DEQUANT_X86
  return (__builtin_ia32_stmxcsr() & 0x40u) != 0;
#else
  return true;  // unknown: take the paths that hold either way
#endif
}

dequant_internal::Isa DetectIsa() {
#if SHARDCAST_DEQUANT_X86
  __builtin_cpu_init();  // the checks include the OS's support for the AVX and AVX-512 register state
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  const bool f16c = __get_cpuid(1, &eax, &ebx, &ecx, &edx) && (ecx & bit_F16C) != 0;  // clang's builtin lacks "f16c"
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("bmi") &&
                    __builtin_cpu_supports("bmi2") && f16c;
  const bool avx512 = avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  if (avx512) return dequant_internal::Isa::kAvx512;
  if (avx2) return dequant_internal::Isa::kAvx2;
#endif
  return dequant_internal::Isa::kBaseline;
}

bool IsWeightDType(DType d) { return d == DType::kF8_E4M3 || d == DType::kF8_E5M2; }
bool IsScaleDType(DType d) {
  return d == DType::kF32 || d == DType::kBF16 || d == DType::kF16 || d == DType::kF8_E8M0 || d == DType::kU8;
}
bool IsTargetDType(DType d) { return d == DType::kBF16 || d == DType::kF16 || d == DType::kF32; }

uint64_t CeilDiv(uint64_t a, uint64_t b) { return a / b + (a % b != 0); }

float DecodeScale(DType dtype, const unsigned char* p) {
  switch (dtype) {
    case DType::kF32: {
      float f;
      std::memcpy(&f, p, 4);
      return f;
    }
    case DType::kBF16:
    case DType::kF16: {
      uint16_t h;
      std::memcpy(&h, p, 2);
      return dtype == DType::kBF16 ? BFloat16BitsToFloat(h) : HalfBitsToFloat(h);
    }
    case DType::kU8:  // E8M0 bytes as uint8: 255 is 2^128 (inf), as transformers reads them
      return *p == 0xFF ? std::numeric_limits<float>::infinity() : Fp8E8M0BitsToFloat(*p);
    default:
      return Fp8E8M0BitsToFloat(*p);
  }
}

// Decodes one scale row (grid_used scales) into one float per weight column and picks the row mode.
RowMode ExpandScaleRow(const DequantScale& scale, uint64_t row, uint64_t grid_used, uint64_t cols, uint64_t bw,
                       bool scaled_bits_allowed, float* out) {
  const size_t ss = DTypeSize(scale.dtype);
  const auto* p = static_cast<const unsigned char*>(scale.data) + row * scale.grid_cols * ss;
  bool nan = false, in_range = true;
  for (uint64_t j = 0, c0 = 0; j < grid_used; ++j, c0 += bw) {
    const float s = DecodeScale(scale.dtype, p + j * ss);
    nan |= IsNanBits(Bits(s));
    in_range &= std::fabs(s) < kScaledBitsLimit;  // false for NaN
    const uint64_t c1 = cols - c0 <= bw ? cols : c0 + bw;
    std::fill(out + c0, out + c1, s);
  }
  if (nan) return RowMode::kNanScales;
  if (!scaled_bits_allowed || !in_range) return RowMode::kPlain;
  for (uint64_t c = 0; c < cols; ++c) out[c] *= kScaledBitsFactor;  // exact: a power of two, no overflow
  return RowMode::kScaledBits;
}

std::string BlockText(BlockSize b) { return std::to_string(b.rows) + " x " + std::to_string(b.cols); }

std::string UnsupportedText(DType weight, DType scale, DType target) {
  return "cannot dequantize " + std::string(DTypeName(weight)) + " weights with " +
         std::string(DTypeName(scale)) + " scales to " + std::string(DTypeName(target)) +
         " (weights: F8_E4M3 or F8_E5M2; scales: F32, BF16, F16, F8_E8M0 or U8; targets: BF16, F16 or F32)";
}

}  // namespace

ScaleGrid ScaleGridFor(uint64_t rows, uint64_t cols, BlockSize block) {
  return {CeilDiv(rows, block.rows), CeilDiv(cols, block.cols)};
}

RowSpan ScaleRowsFor(RowSpan rows, BlockSize block) {
  if (rows.end <= rows.begin) return {};
  return {rows.begin / block.rows, CeilDiv(rows.end, block.rows)};
}

bool CanDequantize(DType weight, DType scale, DType target) {
  return IsWeightDType(weight) && IsScaleDType(scale) && IsTargetDType(target);
}

namespace dequant_internal {

Isa BestIsa() {
  static const Isa best = DetectIsa();
  return best;
}

std::string_view IsaName(Isa isa) {
  switch (isa) {
    case Isa::kAvx2: return "avx2";
    case Isa::kAvx512: return "avx512";
    default: return "baseline";
  }
}

std::vector<Isa> SupportedIsas() {
  const Isa best = BestIsa();
  std::vector<Isa> out = {Isa::kBaseline};
  if (best == Isa::kAvx2 || best == Isa::kAvx512) out.push_back(Isa::kAvx2);
  if (best == Isa::kAvx512) out.push_back(Isa::kAvx512);
  return out;
}

void DequantizeWithIsa(Isa isa, const DequantSource& weight, const DequantScale& scale, RowSpan rows,
                       uint64_t cols, BlockSize block, DType target, void* out) {
  if (!CanDequantize(weight.dtype, scale.dtype, target)) {
    throw Error(ErrorKind::kUnsupported, "dequantize", UnsupportedText(weight.dtype, scale.dtype, target));
  }
  if (isa > BestIsa()) {
    throw Error(ErrorKind::kInvalidArgument, "dequantize",
                "this CPU cannot run the " + std::string(IsaName(isa)) + " kernels");
  }
  if (block.rows == 0 || block.cols == 0) {
    throw Error(ErrorKind::kInvalidArgument, "dequantize", "block size " + BlockText(block) + " has a zero side");
  }
  if (rows.end < rows.begin) {
    throw Error(ErrorKind::kInvalidArgument, "dequantize",
                "row range [" + std::to_string(rows.begin) + ", " + std::to_string(rows.end) +
                    ") ends before it begins");
  }
  const uint64_t grid_used = CeilDiv(cols, block.cols);
  if (scale.grid_cols < grid_used) {
    throw Error(ErrorKind::kInvalidArgument, "dequantize",
                "scale rows of " + std::to_string(scale.grid_cols) + " do not cover " + std::to_string(cols) +
                    " columns in blocks of " + BlockText(block) + " (need " + std::to_string(grid_used) + ")");
  }
  if (rows.size() == 0 || cols == 0) return;

  const auto& kernels = KernelsOf(isa)[weight.dtype == DType::kF8_E5M2];
  const int t = target == DType::kBF16 ? 0 : target == DType::kF16 ? 1 : 2;
  const bool scaled_bits_allowed = weight.dtype == DType::kF8_E4M3 && !DenormalsAreZero();
  const auto* w = static_cast<const uint8_t*>(weight.data);
  auto* o = static_cast<unsigned char*>(out);
  const size_t ts = DTypeSize(target);
  const uint64_t first_grid_row = rows.begin / block.rows;
  std::vector<float> expanded(cols);
  // One block row at a time: expand its scales, then run each of its weight rows in the range.
  for (uint64_t r = rows.begin; r < rows.end;) {
    const uint64_t g = r / block.rows;
    const uint64_t left_in_block = block.rows - r % block.rows;
    const uint64_t r_end = rows.end - r <= left_in_block ? rows.end : r + left_in_block;
    const RowMode mode = ExpandScaleRow(scale, g - first_grid_row, grid_used, cols, block.cols, scaled_bits_allowed,
                                        expanded.data());
    const RowFn row_fn = kernels[static_cast<int>(mode)][t];
    for (; r < r_end; ++r) {
      const uint64_t i = r - rows.begin;
      row_fn(w + i * cols, expanded.data(), cols, o + i * cols * ts);
    }
  }
}

}  // namespace dequant_internal

void Dequantize(const DequantSource& weight, const DequantScale& scale, RowSpan rows, uint64_t cols,
                BlockSize block, DType target, void* out) {
  dequant_internal::DequantizeWithIsa(dequant_internal::BestIsa(), weight, scale, rows, cols, block, target, out);
}

std::string ScaleKeyFor(std::string_view weight_key) { return std::string(weight_key) + "_scale_inv"; }

void CheckDequantizable(std::string_view key, DType weight, DType scale, DType target) {
  if (!CanDequantize(weight, scale, target)) {
    throw Error(ErrorKind::kUnsupported, std::string(key), UnsupportedText(weight, scale, target));
  }
}

void CheckScaleShape(std::string_view key, const std::vector<uint64_t>& weight_shape,
                     const std::vector<uint64_t>& scale_shape, BlockSize block) {
  const std::string context(key);
  if (block.rows == 0 || block.cols == 0) {
    throw Error(ErrorKind::kInvalidArgument, context, "block size " + BlockText(block) + " has a zero side");
  }
  if (weight_shape.size() != 2) {
    throw Error(ErrorKind::kCheckpoint, context,
                "a block-quantized weight must be 2-D, got shape " + ShapeText(weight_shape));
  }
  const ScaleGrid g = ScaleGridFor(weight_shape[0], weight_shape[1], block);
  if (scale_shape.size() != 2 || scale_shape[0] != g.rows || scale_shape[1] != g.cols) {
    throw Error(ErrorKind::kCheckpoint, context,
                "scale " + ScaleKeyFor(key) + " has shape " + ShapeText(scale_shape) + ", but weight shape " +
                    ShapeText(weight_shape) + " in blocks of " + BlockText(block) + " needs " +
                    ShapeText({g.rows, g.cols}));
  }
}

}  // namespace shardcast
