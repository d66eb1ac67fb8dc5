// Test inputs for the dequantization kernel, shared by the pure test and the torch bit-exactness
// test: a whole fp8 weight with its full scale grid, every byte pattern among the weights, and scales
// that vary per block with NaN, inf, zero, denormal and overflowing values among them.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "loaders/quant/dequant.h"

namespace shardcast::testing {

inline constexpr DType kDequantWeights[] = {DType::kF8_E4M3, DType::kF8_E5M2};
// U8: E8M0 exponent bytes stored as uint8 (MXFP8 / ue8m0 checkpoints), 255 read as 2^128.
inline constexpr DType kDequantScales[] = {DType::kF32, DType::kBF16, DType::kF16, DType::kF8_E8M0, DType::kU8};
inline constexpr DType kDequantTargets[] = {DType::kBF16, DType::kF16, DType::kF32};

uint32_t FloatBits(float f);
float BitsToFloat(uint32_t u);

// A whole [rows, cols] weight and its full scale grid.
struct DequantCase {
  DType weight, scale;
  uint64_t rows, cols;
  BlockSize block;
  std::vector<unsigned char> w, s;  // w: rows * cols bytes; s: the whole grid, row-major

  ScaleGrid grid() const { return ScaleGridFor(rows, cols, block); }
  std::string Name(DType target) const;
  // The rule one element at a time, from dtype.h's scalar conversions.
  std::vector<unsigned char> Reference(DType target) const;
  // Rows [r0, r1) as the stream calls it: copies of only those rows and their scale rows.
  std::vector<unsigned char> Run(DType target, uint64_t r0, uint64_t r1, dequant_internal::Isa isa) const;
  std::vector<unsigned char> Run(DType target) const;  // every row, the best ISA
};

enum class ScaleRange {
  kWide,        // F32: 2^-140 .. 2^40 with quiet and signaling NaNs, +-inf, +-0, denormals, huge normals
  kBelow2To8,   // every |s| < 2^8 (denormals, +-0 and the largest float below 2^8 included): the range
                // of real checkpoints, where the kernel takes its scaled-bits path for E4M3
};

// Every byte pattern appears among the weights where rows * cols >= 256; scales from MakeScales.
DequantCase MakeDequantCase(DType weight, DType scale, uint64_t rows, uint64_t cols, BlockSize block,
                            uint32_t seed = 1, ScaleRange range = ScaleRange::kWide);

// n scales of dtype d, random sign, spread over many binades, with the range's awkward values
// shuffled in among them.
std::vector<unsigned char> MakeScales(DType d, uint64_t n, uint32_t seed, ScaleRange range = ScaleRange::kWide);

// Index of the first element of size es that differs, -1 when equal, -2 when the sizes differ.
int64_t FirstDiff(const std::vector<unsigned char>& a, const std::vector<unsigned char>& b, size_t es);
std::string ElementHex(const std::vector<unsigned char>& v, int64_t i, size_t es);

}  // namespace shardcast::testing

#define EXPECT_SAME_BITS(got, want, target, what)                                                         \
  do {                                                                                                    \
    const size_t es_ = ::shardcast::DTypeSize(target);                                                    \
    const int64_t at_ = ::shardcast::testing::FirstDiff(got, want, es_);                                  \
    EXPECT_EQ(at_, -1) << (what) << ": element " << at_ << " is "                                         \
                       << (at_ >= 0 ? ::shardcast::testing::ElementHex(got, at_, es_) : "") << ", want " \
                       << (at_ >= 0 ? ::shardcast::testing::ElementHex(want, at_, es_) : "");            \
  } while (0)
