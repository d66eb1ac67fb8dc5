#include "loaders/quant/mxfp4.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "allocators/error.h"
#include "tests/loaders/test_util.h"

namespace shardcast {
namespace {

using dequant_internal::Isa;
using mxfp4_internal::Layout;

constexpr DType kTargets[] = {DType::kBF16, DType::kF16, DType::kF32};

// The rule written from the format, independent of the kernel's tables: the E2M1 value by its bits
// (sign, 2-bit exponent with bias 1, 1-bit mantissa; exponent 0 is the subnormal 0 / 0.5), times
// 2^(scale - 127) in double (exact), then one rounding to the target.
uint32_t ReferenceBits(uint8_t nibble, uint8_t scale, DType target) {
  const int sign = nibble >> 3, exp = (nibble >> 1) & 3, man = nibble & 1;
  const double mag = exp == 0 ? 0.5 * man : std::ldexp(1.0 + 0.5 * man, exp - 1);
  const double v = std::ldexp(sign ? -mag : mag, scale - 127);
  const float f = static_cast<float>(v);  // exact but for overflow to inf
  if (target == DType::kBF16) return FloatToBFloat16Bits(f);
  if (target == DType::kF16) return FloatToHalfBits(f);
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

// A stored matrix [rows, cols] with random bytes and scales (every scale value when there are enough).
struct Matrix {
  uint64_t rows, cols;
  std::vector<uint8_t> blocks, scales;

  Matrix(uint64_t r, uint64_t c, uint32_t seed) : rows(r), cols(c), blocks(r * c / 2), scales(r * c / 32) {
    std::mt19937 rng(seed);
    for (auto& b : blocks) b = static_cast<uint8_t>(rng());
    for (size_t i = 0; i < scales.size(); ++i) scales[i] = static_cast<uint8_t>(i % 7 == 0 ? rng() : i * 37 + seed);
  }
  uint32_t Ref(uint64_t r, uint64_t c, DType target) const {
    const uint8_t b = blocks[r * cols / 2 + c / 2];
    return ReferenceBits(c % 2 ? b >> 4 : b & 0x0F, scales[r * cols / 32 + c / 32], target);
  }
  // The rows from `first` on, as a reader that copied only those would pass them.
  Mxfp4Matrix From(uint64_t first) const {
    return Mxfp4Matrix{blocks.data() + first * cols / 2, scales.data() + first * cols / 32, first, cols};
  }
};

uint32_t Load(const std::vector<unsigned char>& out, uint64_t i, DType target) {
  if (target == DType::kF32) {
    uint32_t u;
    std::memcpy(&u, out.data() + 4 * i, 4);
    return u;
  }
  uint16_t h;
  std::memcpy(&h, out.data() + 2 * i, 2);
  return h;
}

// How a test places a window's output: `misalign` elements past a 64-byte line, and the kernel options.
struct Placement {
  uint64_t misalign = 0;
  mxfp4_internal::KernelOptions options;
};

// Runs one window and compares every element (and that the stride's gap and the bytes around the
// output are untouched) with the reference.
void ExpectWindow(Isa isa, const Matrix& m, Layout layout, OutputWindow w, DType target, uint64_t stride,
                  const std::string& what, Placement at = {}) {
  const uint64_t width = w.cols.size(), pitch = stride ? stride : width;
  const size_t ts = DTypeSize(target);
  std::vector<unsigned char> buffer((w.rows.size() * pitch + 1) * ts + 64 + at.misalign * ts + 64, 0xAB);
  const uint64_t lead_bytes = (64 - reinterpret_cast<uintptr_t>(buffer.data()) % 64) % 64 + at.misalign * ts;
  const uint64_t first_stored = layout == Layout::kStored ? w.rows.begin : w.cols.begin;
  mxfp4_internal::DequantizeWithIsa(isa, m.From(first_stored), w, target,
                                    WindowOut{buffer.data() + lead_bytes, stride}, layout, at.options);
  const std::vector<unsigned char> out(buffer.begin() + lead_bytes, buffer.end());
  uint64_t bad = 0;
  for (uint64_t b = 0; b < lead_bytes; ++b) bad += buffer[b] != 0xAB;
  for (uint64_t b = w.rows.size() * pitch * ts; b < out.size(); ++b) bad += out[b] != 0xAB;
  for (uint64_t r = 0; r < w.rows.size(); ++r) {
    for (uint64_t c = 0; c < pitch; ++c) {
      const uint64_t i = r * pitch + c;
      if (c >= width) {
        bad += out[i * ts] != 0xAB;
        continue;
      }
      const uint64_t gr = w.rows.begin + r, gc = w.cols.begin + c;
      const uint32_t want = layout == Layout::kStored ? m.Ref(gr, gc, target) : m.Ref(gc, gr, target);
      const uint32_t got = Load(out, i, target);
      if (got != want && bad++ < 3) {
        ADD_FAILURE() << what << " at [" << gr << ", " << gc << "]: got 0x" << std::hex << got << ", want 0x" << want;
      }
    }
  }
  EXPECT_EQ(bad, 0u) << what;
}

std::string Name(Isa isa, DType target, Layout layout) {
  return std::string(dequant_internal::IsaName(isa)) + " " + std::string(DTypeName(target)) +
         (layout == Layout::kStored ? " stored" : " transposed");
}

TEST(Mxfp4, HandComputedValues) {
  // One row of 32 values: byte 0 = 0x21 (values 0.5, 1.0), byte 1 = 0xF8 (-0, -6), the rest 0x00.
  std::vector<uint8_t> blocks(16, 0), scales = {128};  // x 2
  blocks[0] = 0x21;
  blocks[1] = 0xF8;
  std::vector<uint16_t> out(32, 0xFFFF);
  DequantizeMxfp4(Mxfp4Matrix{blocks.data(), scales.data(), 0, 32}, {{0, 1}, {0, 32}}, DType::kBF16,
                  WindowOut{out.data()});
  EXPECT_EQ(out[0], 0x3F80);  // 1.0
  EXPECT_EQ(out[1], 0x4000);  // 2.0
  EXPECT_EQ(out[2], 0x8000);  // -0
  EXPECT_EQ(out[3], 0xC140);  // -12
  EXPECT_EQ(out[4], 0x0000);
  // The transpose of the same row is a column: out[i][0] = stored[0][i].
  std::vector<uint16_t> col(32, 0xFFFF);
  DequantizeMxfp4Transposed(Mxfp4Matrix{blocks.data(), scales.data(), 0, 32}, {{0, 32}, {0, 1}}, DType::kBF16,
                            WindowOut{col.data()});
  EXPECT_EQ(col, out);
}

TEST(Mxfp4, ExtremeScalesAsTransformersReadsThem) {
  // Scale 0: 0.5 * 2^-127 = 2^-128, a BF16 / F32 subnormal, zero in F16. Scale 255 is 2^128, not NaN:
  // 0.5 * 2^128 = 2^127, 1.0 * 2^128 = inf, 0 * 2^128 = 0. Scale 142: 6 * 2^15 overflows F16.
  EXPECT_EQ(ReferenceBits(1, 0, DType::kBF16), 0x0020u);
  EXPECT_EQ(ReferenceBits(1, 0, DType::kF16), 0x0000u);
  EXPECT_EQ(ReferenceBits(1, 0, DType::kF32), 0x00200000u);
  EXPECT_EQ(ReferenceBits(1, 255, DType::kBF16), 0x7F00u);
  EXPECT_EQ(ReferenceBits(2, 255, DType::kBF16), 0x7F80u);
  EXPECT_EQ(ReferenceBits(0, 255, DType::kF32), 0u);
  EXPECT_EQ(ReferenceBits(7, 142, DType::kF16), 0x7C00u);
  EXPECT_EQ(ReferenceBits(15, 142, DType::kF16), 0xFC00u);
  // Every (scale, byte) pair through every kernel: 256 stored rows, row s with scale s in each group.
  Matrix m(256, 512, 0);
  for (uint64_t r = 0; r < 256; ++r) {
    for (uint64_t j = 0; j < 256; ++j) m.blocks[r * 256 + j] = static_cast<uint8_t>(j);
    for (uint64_t g = 0; g < 16; ++g) m.scales[r * 16 + g] = static_cast<uint8_t>(r);
  }
  for (Isa isa : dequant_internal::SupportedIsas()) {
    for (DType t : kTargets) {
      for (Layout l : {Layout::kStored, Layout::kTransposed}) {
        const OutputWindow w = l == Layout::kStored ? OutputWindow{{0, 256}, {0, 512}} : OutputWindow{{0, 512}, {0, 256}};
        ExpectWindow(isa, m, l, w, t, 0, Name(isa, t, l) + " every pair");
      }
    }
  }
}

TEST(Mxfp4, EveryWindowEveryIsaEqualsTheReference) {
  // Odd windows: starting and ending inside groups and tiles, a first_row offset, strided output.
  const Matrix m(75, 160, 7);  // 75 stored rows: two full 32-row tiles and a partial one
  struct Case {
    OutputWindow stored;  // in stored coordinates; the transposed run uses its mirror
    uint64_t stride_pad;
  };
  const Case cases[] = {{{{0, 75}, {0, 160}}, 0},   {{{0, 64}, {0, 64}}, 0},    {{{3, 70}, {5, 150}}, 0},
                        {{{31, 33}, {31, 33}}, 3}, {{{10, 11}, {0, 160}}, 0},  {{{0, 75}, {96, 128}}, 5},
                        {{{40, 40}, {0, 160}}, 0}, {{{1, 74}, {17, 159}}, 1}, {{{32, 64}, {64, 96}}, 0}};
  for (Isa isa : dequant_internal::SupportedIsas()) {
    for (DType t : kTargets) {
      for (const Case& c : cases) {
        const OutputWindow s = c.stored, tr{s.cols, s.rows};
        const std::string where = " window [" + std::to_string(s.rows.begin) + ", " + std::to_string(s.rows.end) +
                                  ") x [" + std::to_string(s.cols.begin) + ", " + std::to_string(s.cols.end) + ")";
        ExpectWindow(isa, m, Layout::kStored, s, t, c.stride_pad ? s.cols.size() + c.stride_pad : 0,
                     Name(isa, t, Layout::kStored) + where);
        ExpectWindow(isa, m, Layout::kTransposed, tr, t, c.stride_pad ? tr.cols.size() + c.stride_pad : 0,
                     Name(isa, t, Layout::kTransposed) + where);
      }
    }
  }
}

TEST(Mxfp4, StreamedTransposedWindowsEqualTheReference) {
  // The transposed kernel's streamed path (whole 64-byte lines, non-temporal) on small windows: row
  // strides of whole lines, outputs 0 to 31 elements past a line (so the first tile of every group
  // band is cut to reach a line), windows that start and end inside groups, 16-value bands and tiles,
  // odd stored-row counts; and the same windows unstreamed.
  const Matrix m(203, 320, 13);  // 203 stored rows: six full 32-row tiles and 11 more
  struct Case {
    OutputWindow w;  // transposed: rows are values (in), columns stored rows (out)
    uint64_t stride;  // elements; a multiple of 32 (BF16, F16) or 16 (F32) keeps rows on lines
  };
  const Case cases[] = {{{{0, 320}, {0, 203}}, 224},  {{{5, 301}, {3, 200}}, 224}, {{{37, 38}, {0, 203}}, 256},
                        {{{64, 192}, {1, 202}}, 256}, {{{17, 150}, {33, 130}}, 128}, {{{0, 320}, {40, 72}}, 64},
                        {{{250, 319}, {0, 65}}, 96}};
  mxfp4_internal::KernelOptions always;
  always.stream_min_bytes = 0;
  for (Isa isa : dequant_internal::SupportedIsas()) {
    for (DType t : kTargets) {
      for (const Case& c : cases) {
        for (uint64_t misalign : {0, 1, 8, 13, 31}) {
          for (const bool streamed : {true, false}) {
            const std::string what = Name(isa, t, Layout::kTransposed) + " window [" + std::to_string(c.w.rows.begin) +
                                     ", " + std::to_string(c.w.rows.end) + ") x [" + std::to_string(c.w.cols.begin) +
                                     ", " + std::to_string(c.w.cols.end) + ") misaligned " + std::to_string(misalign) +
                                     (streamed ? " streamed" : "");
            ExpectWindow(isa, m, Layout::kTransposed, c.w, t, c.stride, what,
                         Placement{misalign, streamed ? always : mxfp4_internal::KernelOptions{}});
          }
        }
      }
    }
  }
}

TEST(Mxfp4, LargeTransposedWindowStreamsByDefault) {
  // One window past the default threshold (4 MiB of BF16: 1024 x 2112), packed, as the stream writes an
  // expert's rows; the kernel chooses to stream by itself.
  const Matrix m(2112, 1024, 17);
  for (Isa isa : dequant_internal::SupportedIsas()) {
    ExpectWindow(isa, m, Layout::kTransposed, {{0, 1024}, {0, 2112}}, DType::kBF16, 0,
                 Name(isa, DType::kBF16, Layout::kTransposed) + " 4 MiB window", Placement{8, {}});
  }
}

TEST(Mxfp4, AnySplitGivesTheSameBytes) {
  // The model's rows of one expert in pieces (as a reader writes them chunk by chunk) equal one call.
  const Matrix m(96, 256, 11);
  std::vector<uint16_t> whole(256 * 96), pieces(256 * 96, 0);
  DequantizeMxfp4Transposed(m.From(0), {{0, 256}, {0, 96}}, DType::kBF16, WindowOut{whole.data()});
  for (uint64_t i0 = 0; i0 < 256; i0 += 45) {
    const uint64_t i1 = std::min<uint64_t>(256, i0 + 45);
    DequantizeMxfp4Transposed(m.From(0), {{i0, i1}, {0, 96}}, DType::kBF16, WindowOut{pieces.data() + i0 * 96});
  }
  EXPECT_EQ(whole, pieces);
}

TEST(Mxfp4, RefusesWhatItCannotDo) {
  const Matrix m(4, 64, 1);
  std::vector<unsigned char> out(4 * 64 * 4);
  EXPECT_SC_ERROR(DequantizeMxfp4(m.From(0), {{0, 4}, {0, 64}}, DType::kF8_E4M3, WindowOut{out.data()}),
                  ErrorKind::kUnsupported, "F8_E4M3");
  Mxfp4Matrix odd = m.From(0);
  odd.cols = 48;
  EXPECT_SC_ERROR(DequantizeMxfp4(odd, {{0, 1}, {0, 8}}, DType::kBF16, WindowOut{out.data()}),
                  ErrorKind::kInvalidArgument, "not a multiple of 32");
  EXPECT_SC_ERROR(DequantizeMxfp4(m.From(0), {{0, 4}, {0, 65}}, DType::kBF16, WindowOut{out.data()}),
                  ErrorKind::kInvalidArgument, "not within");
  EXPECT_SC_ERROR(DequantizeMxfp4Transposed(m.From(2), {{0, 64}, {1, 4}}, DType::kBF16, WindowOut{out.data()}),
                  ErrorKind::kInvalidArgument, "stored rows from 2");
  EXPECT_SC_ERROR(DequantizeMxfp4(m.From(0), {{3, 2}, {0, 8}}, DType::kBF16, WindowOut{out.data()}),
                  ErrorKind::kInvalidArgument, "not within");
}

TEST(Mxfp4, PairShapesAreCheckedByName) {
  const std::string key = "model.layers.0.mlp.experts.gate_up_proj";
  EXPECT_EQ(Mxfp4ModelShape({4, 10, 3, 16}), (std::vector<uint64_t>{4, 96, 10}));
  EXPECT_TRUE(Mxfp4ModelShape({4, 10, 3, 8}).empty());
  EXPECT_NO_THROW(CheckMxfp4Pair(key, DType::kU8, {4, 10, 3, 16}, DType::kU8, {4, 10, 3}, {4, 96, 10}, DType::kBF16));
  // scales that do not pair with the blocks; a model shape that is not the blocks' transpose
  const std::string both = "'" + key + "_blocks' [4, 10, 3, 16] and '" + key + "_scales' [4, 10, 2]";
  EXPECT_SC_ERROR(CheckMxfp4Pair(key, DType::kU8, {4, 10, 3, 16}, DType::kU8, {4, 10, 2}, {4, 96, 10}, DType::kBF16),
                  ErrorKind::kCheckpoint, both.c_str());
  EXPECT_SC_ERROR(CheckMxfp4Pair(key, DType::kU8, {4, 10, 3, 16}, DType::kU8, {4, 10, 3}, {4, 10, 96}, DType::kBF16),
                  ErrorKind::kCheckpoint, "the model's [4, 10, 96]");
  EXPECT_SC_ERROR(CheckMxfp4Pair(key, DType::kBF16, {4, 10, 3, 16}, DType::kU8, {4, 10, 3}, {4, 96, 10}, DType::kBF16),
                  ErrorKind::kUnsupported, "blocks BF16");
  EXPECT_NO_THROW(
      CheckMxfp4Pair(key, DType::kU8, {10, 3, 16}, DType::kF8_E8M0, {10, 3}, {96, 10}, DType::kF32));
}

}  // namespace
}  // namespace shardcast
