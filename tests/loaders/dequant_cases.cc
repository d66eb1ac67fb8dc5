#include "tests/loaders/dequant_cases.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>

namespace shardcast::testing {
namespace {

float RefWeight(DType d, uint8_t b) { return d == DType::kF8_E4M3 ? Fp8E4M3BitsToFloat(b) : Fp8E5M2BitsToFloat(b); }

float RefScale(DType d, const unsigned char* p) {
  uint16_t h;
  switch (d) {
    case DType::kF32: {
      float f;
      std::memcpy(&f, p, 4);
      return f;
    }
    case DType::kBF16: std::memcpy(&h, p, 2); return BFloat16BitsToFloat(h);
    case DType::kF16: std::memcpy(&h, p, 2); return HalfBitsToFloat(h);
    case DType::kU8: return *p == 0xFF ? BitsToFloat(0x7F800000u) : std::ldexp(1.0f, *p - 127);
    default: return Fp8E8M0BitsToFloat(*p);
  }
}

// A NaN scale gives quiet(scale) whatever the weight; otherwise the one fp32 product.
float RefProduct(float w, float s) { return std::isnan(s) ? BitsToFloat(FloatBits(s) | 0x400000u) : w * s; }

void RefStore(DType target, float p, unsigned char* out) {
  if (target == DType::kF32) {
    std::memcpy(out, &p, 4);
    return;
  }
  uint16_t h;
  const uint32_t u = FloatBits(p);
  if (target == DType::kBF16) {
    h = std::isnan(p) ? 0xFFFF : FloatToBFloat16Bits(p);
  } else {
    h = std::isnan(p) ? static_cast<uint16_t>(((u >> 16) & 0x8000u) | 0x7E00u | ((u >> 13) & 0x3FFu))
                      : FloatToHalfBits(p);
  }
  std::memcpy(out, &h, 2);
}

}  // namespace

uint32_t FloatBits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

float BitsToFloat(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

std::string DequantCase::Name(DType target) const {
  return std::string(DTypeName(weight)) + " x " + std::string(DTypeName(scale)) + " -> " +
         std::string(DTypeName(target)) + " [" + std::to_string(rows) + ", " + std::to_string(cols) + "] in " +
         std::to_string(block.rows) + " x " + std::to_string(block.cols);
}

std::vector<unsigned char> DequantCase::Reference(DType target) const {
  const size_t ts = DTypeSize(target), ss = DTypeSize(scale);
  const uint64_t gc = grid().cols;
  std::vector<unsigned char> out(rows * cols * ts);
  for (uint64_t r = 0; r < rows; ++r) {
    for (uint64_t c = 0; c < cols; ++c) {
      const float s_rc = RefScale(scale, s.data() + ((r / block.rows) * gc + c / block.cols) * ss);
      RefStore(target, RefProduct(RefWeight(weight, w[r * cols + c]), s_rc), out.data() + (r * cols + c) * ts);
    }
  }
  return out;
}

std::vector<unsigned char> DequantCase::Run(DType target, uint64_t r0, uint64_t r1, dequant_internal::Isa isa) const {
  const RowSpan g = ScaleRowsFor({r0, r1}, block);
  std::vector<unsigned char> out((r1 - r0) * cols * DTypeSize(target));
  // Copies, so that ASan sees any read outside exactly what the contract hands over.
  std::vector<unsigned char> wpart(w.begin() + r0 * cols, w.begin() + r1 * cols);
  const size_t row_bytes = grid().cols * DTypeSize(scale);
  std::vector<unsigned char> spart(s.begin() + g.begin * row_bytes, s.begin() + g.end * row_bytes);
  dequant_internal::DequantizeWithIsa(isa, {weight, wpart.data()}, {scale, spart.data(), grid().cols}, {r0, r1}, cols,
                                      block, target, out.data());
  return out;
}

std::vector<unsigned char> DequantCase::Run(DType target) const {
  return Run(target, 0, rows, dequant_internal::SupportedIsas().back());
}

std::vector<unsigned char> MakeScales(DType d, uint64_t n, uint32_t seed, ScaleRange range) {
  const bool wide = range == ScaleRange::kWide;
  std::mt19937 rng(seed);
  const size_t es = DTypeSize(d);
  std::vector<unsigned char> out(n * es);
  for (uint64_t i = 0; i < n; ++i) {
    unsigned char* p = out.data() + i * es;
    const uint32_t r = rng();
    if (d == DType::kF8_E8M0 || d == DType::kU8) {  // 2^(e - 127): e < 135 is below 2^8
      static const uint8_t kWide[] = {0xFF, 0, 1, 2, 254, 127, 100, 150};
      static const uint8_t kBelow[] = {0, 1, 2, 134, 127, 100, 120, 113};
      *p = i < 8 ? (wide ? kWide : kBelow)[i] : static_cast<uint8_t>(wide ? r : r % 135);
      continue;
    }
    if (d == DType::kF16) {  // exponent field < 23 is below 2^8
      static const uint16_t kWide[] = {0x7E00, 0x7C01, 0xFE05, 0x7C00, 0xFC00, 0x0000, 0x8000, 0x0001, 0x7BFF, 0x0400};
      static const uint16_t kBelow[] = {0x0000, 0x8000, 0x0001, 0x83FF, 0x5BFF, 0xDBFF, 0x0400, 0x3C00, 0x1000, 0x2000};
      uint16_t h = static_cast<uint16_t>(r >> 16);
      if (wide && (h & 0x7C00) == 0x7C00) h &= 0xBFFF;  // random draws stay finite
      if (!wide) h = static_cast<uint16_t>((h & 0x83FF) | (((r >> 3) % 23) << 10));
      if (i < 10) h = (wide ? kWide : kBelow)[i];
      std::memcpy(p, &h, 2);
      continue;
    }
    // F32 (BF16 takes its top half). Wide: exponents 2^-140 .. 2^40. Below 2^8: fields 0 .. 134.
    static const uint32_t kWide[] = {0x7FC00000u, 0x7F800001u, 0xFFA00123u, 0x7F800000u, 0xFF800000u,
                                     0x00000000u, 0x80000000u, 0x00012345u, 0x7F000000u, 0x00800000u};
    static const uint32_t kBelow[] = {0x00000000u, 0x80000000u, 0x00012345u, 0x80400000u, 0x437FFFFFu,
                                      0xC37F0000u, 0x00800000u, 0x38800000u, 0x3C000000u, 0x00000001u};
    const uint32_t exp = wide ? static_cast<uint32_t>(127 - 140 + (r >> 8) % 181) & 0xFFu : (r >> 8) % 135;
    uint32_t f = (r & 0x80000000u) | (exp << 23) | (r & 0x7FFFFFu);
    if (i < 10) f = (wide ? kWide : kBelow)[i];
    if (d == DType::kF32) {
      std::memcpy(p, &f, 4);
    } else {
      const uint16_t h = static_cast<uint16_t>(f >> 16);
      std::memcpy(p, &h, 2);
    }
  }
  for (uint64_t i = n; i > 1; --i) {  // the specials to random blocks, still a pure function of the seed
    const uint64_t j = rng() % i;
    for (size_t b = 0; b < es; ++b) std::swap(out[(i - 1) * es + b], out[j * es + b]);
  }
  return out;
}

DequantCase MakeDequantCase(DType weight, DType scale, uint64_t rows, uint64_t cols, BlockSize block, uint32_t seed,
                            ScaleRange range) {
  DequantCase c{weight, scale, rows, cols, block, {}, {}};
  std::mt19937 rng(seed);
  c.w.resize(rows * cols);
  for (uint64_t i = 0; i < c.w.size(); ++i) c.w[i] = i < 256 ? static_cast<uint8_t>(i) : static_cast<uint8_t>(rng());
  std::shuffle(c.w.begin(), c.w.end(), rng);
  const ScaleGrid g = c.grid();
  c.s = MakeScales(scale, g.rows * g.cols, seed + 7, range);
  return c;
}

int64_t FirstDiff(const std::vector<unsigned char>& a, const std::vector<unsigned char>& b, size_t es) {
  if (a.size() != b.size()) return -2;
  for (size_t i = 0; i < a.size(); i += es) {
    if (std::memcmp(a.data() + i, b.data() + i, es) != 0) return static_cast<int64_t>(i / es);
  }
  return -1;
}

std::string ElementHex(const std::vector<unsigned char>& v, int64_t i, size_t es) {
  uint32_t u = 0;
  std::memcpy(&u, v.data() + i * es, es);
  char buf[16];
  std::snprintf(buf, sizeof buf, "0x%0*x", static_cast<int>(2 * es), u);
  return buf;
}

}  // namespace shardcast::testing
