#include "loaders/quant/dequant.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <iostream>
#include <random>
#include <string>
#include <vector>

#include "tests/loaders/dequant_cases.h"
#include "tests/loaders/test_util.h"

namespace shardcast {
namespace {

using dequant_internal::Isa;

using testing::DequantCase;
using testing::FloatBits;
using testing::MakeDequantCase;
using testing::ScaleRange;
constexpr ScaleRange kRanges[] = {ScaleRange::kWide, ScaleRange::kBelow2To8};
constexpr auto& kWeights = testing::kDequantWeights;
constexpr auto& kScales = testing::kDequantScales;
constexpr auto& kTargets = testing::kDequantTargets;

uint32_t Bits(float f) { return FloatBits(f); }

template <typename T>
std::vector<unsigned char> Raw(std::initializer_list<T> v) {
  std::vector<unsigned char> out(v.size() * sizeof(T));
  std::memcpy(out.data(), v.begin(), out.size());
  return out;
}

std::vector<uint16_t> U16(const std::vector<unsigned char>& v) {
  std::vector<uint16_t> out(v.size() / 2);
  std::memcpy(out.data(), v.data(), v.size());
  return out;
}
std::vector<uint32_t> U32(const std::vector<unsigned char>& v) {
  std::vector<uint32_t> out(v.size() / 4);
  std::memcpy(out.data(), v.data(), v.size());
  return out;
}

// ---- tests ------------------------------------------------------------------------------------

TEST(Dequant, HandComputedValues) {
  // [2, 4] E4M3 in 1 x 2 blocks, F32 scales [[0.5, 2], [-1, 0.25]]:
  //   row 0: 1.0 * 0.5, 2.0 * 0.5, -3.0 * 2, 448 * 2  = 0.5, 1, -6, 896
  //   row 1: 2^-9 * -1, 2^-6 * -1, 0 * 0.25, -0 * 0.25 = -2^-9, -2^-6, 0, -0
  DequantCase c{DType::kF8_E4M3, DType::kF32, 2, 4, {1, 2}, {0x38, 0x40, 0xC4, 0x7E, 0x01, 0x08, 0x00, 0x80},
         Raw<float>({0.5f, 2.0f, -1.0f, 0.25f})};
  EXPECT_EQ(U16(c.Run(DType::kBF16)),
            (std::vector<uint16_t>{0x3F00, 0x3F80, 0xC0C0, 0x4460, 0xBB00, 0xBC80, 0x0000, 0x8000}));
  EXPECT_EQ(U16(c.Run(DType::kF16)),
            (std::vector<uint16_t>{0x3800, 0x3C00, 0xC600, 0x6300, 0x9800, 0xA400, 0x0000, 0x8000}));
  EXPECT_EQ(U32(c.Run(DType::kF32)), (std::vector<uint32_t>{Bits(0.5f), Bits(1.0f), Bits(-6.0f), Bits(896.0f),
                                                           Bits(-0x1p-9f), Bits(-0x1p-6f), 0u, 0x80000000u}));
  // E5M2: 1.0 (0x3C), -1.5 (0xBE), 57344 (0x7B, the largest), 2^-16 (0x01, the smallest subnormal).
  DequantCase e{DType::kF8_E5M2, DType::kF32, 1, 4, {128, 128}, {0x3C, 0xBE, 0x7B, 0x01}, Raw<float>({4.0f})};
  EXPECT_EQ(U32(e.Run(DType::kF32)),
            (std::vector<uint32_t>{Bits(4.0f), Bits(-6.0f), Bits(229376.0f), Bits(0x1p-14f)}));
}

TEST(Dequant, RoundsToNearestEvenOnce) {
  // 1.0 * (1 + 2^-8) lies halfway between two bf16 values: ties to even (down); 1 + 3 * 2^-8 rounds up.
  DequantCase c{DType::kF8_E4M3, DType::kF32, 1, 2, {1, 1}, {0x38, 0x38}, Raw<uint32_t>({0x3F808000u, 0x3F818000u})};
  EXPECT_EQ(U16(c.Run(DType::kBF16)), (std::vector<uint16_t>{0x3F80, 0x3F82}));
  DequantCase h{DType::kF8_E4M3, DType::kF32, 1, 2, {1, 1}, {0x38, 0x38},
                Raw<float>({1.0f + 0x1p-11f, 1.0f + 3 * 0x1p-11f})};
  EXPECT_EQ(U16(h.Run(DType::kF16)), (std::vector<uint16_t>{0x3C00, 0x3C02}));
  // The product is rounded to fp32 first, then to the target: 1.75 * (1 + 2^-23) = 1.75 + 1.75 * 2^-23
  // rounds in fp32 to 1.75 + 2^-22, not an exact product held wider.
  DequantCase p{DType::kF8_E4M3, DType::kF32, 1, 1, {1, 1}, {0x3E}, Raw<float>({1.0f + 0x1p-23f})};
  EXPECT_EQ(U32(p.Run(DType::kF32)), (std::vector<uint32_t>{Bits(1.75f + 0x1p-22f)}));
  // Overflow: 448 * 2^120 is inf in fp32; 448 * 2^8 = 114688 overflows f16 but not bf16.
  DequantCase o{DType::kF8_E4M3, DType::kF32, 1, 2, {1, 1}, {0x7E, 0x7E}, Raw<float>({0x1p120f, 0x1p8f})};
  EXPECT_EQ(U32(o.Run(DType::kF32))[0], 0x7F800000u);
  EXPECT_EQ(U16(o.Run(DType::kF16)), (std::vector<uint16_t>{0x7C00, 0x7C00}));
  EXPECT_EQ(U16(o.Run(DType::kBF16)), (std::vector<uint16_t>{0x7F80, 0x47E0}));
}

TEST(Dequant, NanBitsAreTorchs) {
  // E4M3 NaN (0x7F, 0xFF) times 1: f32 keeps the decoded NaN; bf16 is 0xFFFF; f16 keeps the payload's top.
  DequantCase n{DType::kF8_E4M3, DType::kF32, 1, 2, {1, 2}, {0x7F, 0xFF}, Raw<float>({1.0f})};
  EXPECT_EQ(U32(n.Run(DType::kF32)), (std::vector<uint32_t>{0x7FF00000u, 0xFFF00000u}));
  EXPECT_EQ(U16(n.Run(DType::kBF16)), (std::vector<uint16_t>{0xFFFF, 0xFFFF}));
  EXPECT_EQ(U16(n.Run(DType::kF16)), (std::vector<uint16_t>{0x7F80, 0xFF80}));
  // A signaling NaN scale wins over a NaN weight, quieted: 0x7F800001 -> 0x7FC00001.
  DequantCase s{DType::kF8_E4M3, DType::kF32, 1, 2, {1, 2}, {0x7F, 0x38}, Raw<uint32_t>({0x7F800001u})};
  EXPECT_EQ(U32(s.Run(DType::kF32)), (std::vector<uint32_t>{0x7FC00001u, 0x7FC00001u}));
  EXPECT_EQ(U16(s.Run(DType::kF16)), (std::vector<uint16_t>{0x7E00, 0x7E00}));
  // E8M0 0xFF decodes to 0x7F800001 too.
  DequantCase e{DType::kF8_E4M3, DType::kF8_E8M0, 1, 1, {1, 1}, {0x38}, {0xFF}};
  EXPECT_EQ(U32(e.Run(DType::kF32)), (std::vector<uint32_t>{0x7FC00001u}));
  // E5M2 inf * 0 is the hardware's default NaN: 0xFFC00000 on x86 (0x7FC00000 on ARM), as for torch.
  DequantCase z{DType::kF8_E5M2, DType::kF32, 1, 2, {1, 1}, {0x7C, 0xFC}, Raw<float>({0.0f, 2.0f})};
  EXPECT_EQ(U32(z.Run(DType::kF32))[1], 0xFF800000u);
#if defined(__x86_64__)
  EXPECT_EQ(U32(z.Run(DType::kF32))[0], 0xFFC00000u);
  EXPECT_EQ(U16(z.Run(DType::kF16)), (std::vector<uint16_t>{0xFE00, 0xFC00}));
#endif
}

TEST(Dequant, DenormalsAreKept) {
  // 2^-9 * 2^-120 = 2^-129, an fp32 denormal, and a bf16 denormal (0x0010); f16 underflows to 0.
  DequantCase d{DType::kF8_E4M3, DType::kF32, 1, 1, {1, 1}, {0x01}, Raw<float>({0x1p-120f})};
  EXPECT_EQ(U32(d.Run(DType::kF32)), (std::vector<uint32_t>{0x00100000u}));
  EXPECT_EQ(U16(d.Run(DType::kBF16)), (std::vector<uint16_t>{0x0010}));
  EXPECT_EQ(U16(d.Run(DType::kF16)), (std::vector<uint16_t>{0x0000}));
  // An E8M0 scale of e = 0 is 2^-127, itself a denormal: 1.0 * 2^-127 = 0x00400000.
  DequantCase e{DType::kF8_E4M3, DType::kF8_E8M0, 1, 1, {1, 1}, {0x38}, {0x00}};
  EXPECT_EQ(U32(e.Run(DType::kF32)), (std::vector<uint32_t>{0x00400000u}));
  EXPECT_EQ(U16(e.Run(DType::kBF16)), (std::vector<uint16_t>{0x0040}));
  // A subnormal f16 result: 2^-9 * 2^-10 = 2^-19 = 32 * 2^-24.
  DequantCase h{DType::kF8_E4M3, DType::kF32, 1, 1, {1, 1}, {0x01}, Raw<float>({0x1p-10f})};
  EXPECT_EQ(U16(h.Run(DType::kF16)), (std::vector<uint16_t>{0x0020}));
}

// Every weight, scale and target dtype against the scalar rule, with partial blocks at the bottom
// and right edges and block sizes other than 128.
TEST(Dequant, MatchesTheScalarRuleForEveryDTypeCombination) {
  struct Shape {
    uint64_t rows, cols;
    BlockSize block;
  };
  const Shape shapes[] = {{200, 96, {128, 128}}, {576, 96, {64, 32}}, {200, 300, {7, 5}}, {33, 130, {128, 128}},
                          {5, 17, {1, 1}},       {130, 7, {2, 128}}};
  for (const Shape& sh : shapes) {
    for (DType w : kWeights) {
      for (DType s : kScales) {
        for (ScaleRange range : kRanges) {
          const DequantCase c = MakeDequantCase(w, s, sh.rows, sh.cols, sh.block, 1, range);
          for (DType t : kTargets) EXPECT_SAME_BITS(c.Run(t), c.Reference(t), t, c.Name(t));
        }
      }
    }
  }
}

// The published shapes: DeepSeek-V3's kv_a_proj_with_mqa (576 x 7168) and odd ones around it.
TEST(Dequant, PublishedShapesInBlocksOf128) {
  for (uint64_t rows : {576, 200}) {
    for (uint64_t cols : {7168, 96}) {
      for (ScaleRange range : kRanges) {
        const DequantCase c = MakeDequantCase(DType::kF8_E4M3, DType::kF32, rows, cols, {128, 128},
                                              static_cast<uint32_t>(rows + cols), range);
        EXPECT_SAME_BITS(c.Run(DType::kBF16), c.Reference(DType::kBF16), DType::kBF16, c.Name(DType::kBF16));
      }
    }
  }
  const DequantCase e = MakeDequantCase(DType::kF8_E4M3, DType::kF8_E8M0, 576, 7168, {128, 128});
  EXPECT_SAME_BITS(e.Run(DType::kF32), e.Reference(DType::kF32), DType::kF32, e.Name(DType::kF32));
}

// A rank's shard may start and end mid-block; any split of the rows gives the whole's bytes.
TEST(Dequant, AnyRowSplitEqualsTheWhole) {
  std::mt19937 rng(5);
  for (BlockSize b : {BlockSize{128, 128}, BlockSize{64, 32}, BlockSize{7, 5}}) {
    for (DType s : kScales) {
      const DequantCase c = MakeDequantCase(DType::kF8_E4M3, s, 200, 96, b, 11,
                                            s == DType::kF32 ? ScaleRange::kWide : ScaleRange::kBelow2To8);
      for (DType t : kTargets) {
        const std::vector<unsigned char> whole = c.Run(t);
        const size_t row_bytes = c.cols * DTypeSize(t);
        for (int trial = 0; trial < 4; ++trial) {
          std::vector<unsigned char> joined;
          for (uint64_t r0 = 0; r0 < c.rows;) {
            const uint64_t r1 = std::min<uint64_t>(c.rows, r0 + rng() % 90);  // 0-row pieces included
            auto part = c.Run(t, r0, r1, dequant_internal::SupportedIsas().back());
            ASSERT_EQ(part.size(), (r1 - r0) * row_bytes);
            joined.insert(joined.end(), part.begin(), part.end());
            r0 = r1;
          }
          EXPECT_SAME_BITS(joined, whole, t, c.Name(t) + ", split trial " + std::to_string(trial));
        }
        // FSDP2's chunks of 200 rows over 3 ranks: [0, 67), [67, 134), [134, 200).
        auto a = c.Run(t, 0, 67, Isa::kBaseline), m = c.Run(t, 67, 134, Isa::kBaseline),
             z = c.Run(t, 134, 200, Isa::kBaseline);
        a.insert(a.end(), m.begin(), m.end());
        a.insert(a.end(), z.begin(), z.end());
        EXPECT_SAME_BITS(a, whole, t, c.Name(t) + ", three ranks");
      }
    }
  }
}

TEST(Dequant, RowRangeStartingMidBlockUsesItsBlocksScaleRow) {
  // bh = 4: rows [6, 9) need grid rows [1, 3): row 6 and 7 use grid row 1, row 8 grid row 2.
  EXPECT_EQ(ScaleRowsFor({6, 9}, {4, 4}).begin, 1u);
  EXPECT_EQ(ScaleRowsFor({6, 9}, {4, 4}).end, 3u);
  const std::vector<float> grid = {1, 2, 4};  // grid [3, 1]
  const std::vector<unsigned char> w(3, 0x38);  // rows 6, 7, 8 of a [12, 1] weight, all 1.0
  std::vector<float> out(3);
  Dequantize({DType::kF8_E4M3, w.data()}, {DType::kF32, grid.data() + 1, 1}, {6, 9}, 1, {4, 4}, DType::kF32,
             out.data());
  EXPECT_EQ(out, (std::vector<float>{2, 2, 4}));
}

TEST(Dequant, EveryIsaGivesTheSameBits) {
  const auto isas = dequant_internal::SupportedIsas();
  ASSERT_EQ(isas.front(), Isa::kBaseline);
  std::cout << "ISAs on this CPU:";
  for (Isa i : isas) std::cout << " " << dequant_internal::IsaName(i);
  std::cout << "\n";
  // Widths around every vector length, so each ISA's main loop and its tails run.
  for (uint64_t cols : {1, 3, 8, 15, 16, 17, 31, 33, 63, 64, 65, 100, 129, 300}) {
    for (DType w : kWeights) {
      for (DType s : kScales) {
        for (ScaleRange range : kRanges) {
          const DequantCase c = MakeDequantCase(w, s, 9, cols, {4, 8}, static_cast<uint32_t>(cols), range);
          for (DType t : kTargets) {
            const auto base = c.Run(t, 0, c.rows, Isa::kBaseline);
            for (Isa isa : isas) {
              EXPECT_SAME_BITS(c.Run(t, 0, c.rows, isa), base, t,
                               c.Name(t) + " with " + std::string(dequant_internal::IsaName(isa)));
            }
          }
        }
      }
    }
  }
}

// With denormals read as zero (MXCSR.DAZ, e.g. after torch.set_flush_denormal(True)) the kernel leaves
// its scaled-bits path, which shifts E4M3 subnormals into float denormals: they must still count.
TEST(Dequant, SubnormalWeightsSurviveDenormalsAreZero) {
#if defined(__x86_64__)
  const DequantCase c = MakeDequantCase(DType::kF8_E4M3, DType::kF32, 64, 64, {16, 16}, 3, ScaleRange::kBelow2To8);
  const std::vector<unsigned char> plain = c.Run(DType::kF32);
  const unsigned int csr = __builtin_ia32_stmxcsr();
  __builtin_ia32_ldmxcsr(csr | 0x40u);  // DAZ
  const std::vector<unsigned char> daz = c.Run(DType::kF32);
  __builtin_ia32_ldmxcsr(csr);
  // Elements whose scale and product are normal floats are the same either way, subnormal weights included.
  const uint64_t gc = c.grid().cols;
  int subnormal_weights = 0;
  for (uint64_t i = 0; i < c.rows * c.cols; ++i) {
    float s, p;
    std::memcpy(&s, c.s.data() + 4 * ((i / c.cols / 16) * gc + (i % c.cols) / 16), 4);
    std::memcpy(&p, plain.data() + 4 * i, 4);
    if (!std::isnormal(s) || !std::isnormal(p)) continue;
    subnormal_weights += (c.w[i] & 0x78) == 0;
    ASSERT_EQ(std::memcmp(plain.data() + 4 * i, daz.data() + 4 * i, 4), 0) << "element " << i;
  }
  EXPECT_GT(subnormal_weights, 0);
#else
  GTEST_SKIP() << "x86 only";
#endif
}

TEST(Dequant, EmptyRangeWritesNothing) {
  const DequantCase c = MakeDequantCase(DType::kF8_E4M3, DType::kF32, 200, 96, {128, 128});
  std::vector<unsigned char> canary(64, 0xAB);
  for (uint64_t r : {0, 100, 128, 200}) {
    Dequantize({DType::kF8_E4M3, c.w.data()}, {DType::kF32, c.s.data(), 1}, {r, r}, 96, {128, 128}, DType::kBF16,
               canary.data());
  }
  EXPECT_TRUE(ScaleRowsFor({100, 100}, {128, 128}).size() == 0);
  Dequantize({DType::kF8_E4M3, nullptr}, {DType::kF32, nullptr, 0}, {0, 10}, 0, {128, 128}, DType::kBF16,
             canary.data());  // zero columns
  EXPECT_EQ(canary, std::vector<unsigned char>(64, 0xAB));
}

TEST(Dequant, UnalignedBuffers) {
  const DequantCase c = MakeDequantCase(DType::kF8_E4M3, DType::kF32, 40, 37, {16, 16});
  const auto want = c.Reference(DType::kF32);
  std::vector<unsigned char> w(c.w.size() + 1), s(c.s.size() + 3), out(want.size() + 1);
  std::memcpy(w.data() + 1, c.w.data(), c.w.size());
  std::memcpy(s.data() + 3, c.s.data(), c.s.size());
  Dequantize({DType::kF8_E4M3, w.data() + 1}, {DType::kF32, s.data() + 3, c.grid().cols}, {0, 40}, 37, {16, 16},
             DType::kF32, out.data() + 1);
  EXPECT_EQ(std::memcmp(out.data() + 1, want.data(), want.size()), 0);
}

TEST(Dequant, ScaleGridAndRowsWorkedExamples) {
  const ScaleGrid g = ScaleGridFor(576, 7168, {});
  EXPECT_EQ(g.rows, 5u);  // 576 = 4 * 128 + 64: a partial bottom block row
  EXPECT_EQ(g.cols, 56u);
  const ScaleGrid h = ScaleGridFor(200, 96, {64, 32});
  EXPECT_EQ(h.rows, 4u);
  EXPECT_EQ(h.cols, 3u);
  EXPECT_EQ(ScaleGridFor(0, 0, {}).rows, 0u);
  auto rows = [](uint64_t a, uint64_t b) {
    RowSpan s = ScaleRowsFor({a, b}, {128, 128});
    return std::make_pair(s.begin, s.end);
  };
  EXPECT_EQ(rows(0, 128), std::make_pair(uint64_t{0}, uint64_t{1}));
  EXPECT_EQ(rows(100, 300), std::make_pair(uint64_t{0}, uint64_t{3}));
  EXPECT_EQ(rows(128, 129), std::make_pair(uint64_t{1}, uint64_t{2}));
  EXPECT_EQ(rows(384, 576), std::make_pair(uint64_t{3}, uint64_t{5}));
  EXPECT_EQ(rows(7, 7), std::make_pair(uint64_t{0}, uint64_t{0}));
}

TEST(Dequant, SupportedDTypes) {
  for (DType w : kWeights) {
    for (DType s : kScales) {
      for (DType t : kTargets) EXPECT_TRUE(CanDequantize(w, s, t));
    }
  }
  EXPECT_FALSE(CanDequantize(DType::kF8_E8M0, DType::kF32, DType::kBF16));  // E8M0 is a scale type only
  EXPECT_FALSE(CanDequantize(DType::kBF16, DType::kF32, DType::kBF16));
  EXPECT_FALSE(CanDequantize(DType::kF8_E4M3, DType::kF64, DType::kBF16));
  EXPECT_FALSE(CanDequantize(DType::kF8_E4M3, DType::kF32, DType::kF64));
  EXPECT_FALSE(CanDequantize(DType::kF8_E4M3, DType::kF32, DType::kF8_E4M3));
  unsigned char buf[4] = {};
  EXPECT_SC_ERROR(Dequantize({DType::kF8_E4M3, buf}, {DType::kI32, buf, 1}, {0, 1}, 1, {}, DType::kBF16, buf),
                  ErrorKind::kUnsupported, "F8_E4M3", "I32", "BF16");
  EXPECT_SC_ERROR(CheckDequantizable("model.layers.0.mlp.up_proj.weight", DType::kF8_E4M3, DType::kF32, DType::kF64),
                  ErrorKind::kUnsupported, "model.layers.0.mlp.up_proj.weight", "F8_E4M3", "F32", "F64");
  EXPECT_NO_THROW(CheckDequantizable("k", DType::kF8_E5M2, DType::kF8_E8M0, DType::kF16));
}

TEST(Dequant, RejectsBadArguments) {
  unsigned char buf[64] = {};
  EXPECT_SC_ERROR(Dequantize({DType::kF8_E4M3, buf}, {DType::kF32, buf, 1}, {0, 1}, 4, {0, 128}, DType::kBF16, buf),
                  ErrorKind::kInvalidArgument, "0 x 128");
  EXPECT_SC_ERROR(Dequantize({DType::kF8_E4M3, buf}, {DType::kF32, buf, 1}, {5, 4}, 4, {}, DType::kBF16, buf),
                  ErrorKind::kInvalidArgument, "[5, 4)");
  // 300 columns in blocks of 128 need 3 scales per row.
  EXPECT_SC_ERROR(Dequantize({DType::kF8_E4M3, buf}, {DType::kF32, buf, 2}, {0, 0}, 300, {}, DType::kBF16, buf),
                  ErrorKind::kInvalidArgument, "300 columns", "need 3");
}

TEST(Dequant, ScaleShapeMustBeTheGrid) {
  const std::string key = "model.layers.3.self_attn.kv_a_proj_with_mqa.weight";
  EXPECT_EQ(ScaleKeyFor(key), "model.layers.3.self_attn.kv_a_proj_with_mqa.weight_scale_inv");
  EXPECT_NO_THROW(CheckScaleShape(key, {576, 7168}, {5, 56}, {}));
  EXPECT_NO_THROW(CheckScaleShape(key, {200, 96}, {4, 3}, {64, 32}));
  EXPECT_SC_ERROR(CheckScaleShape(key, {576, 7168}, {4, 56}, {}), ErrorKind::kCheckpoint, key.c_str(),
                  "weight_scale_inv", "[4, 56]", "[576, 7168]", "128 x 128", "[5, 56]");
  EXPECT_SC_ERROR(CheckScaleShape(key, {576, 7168}, {5, 57}, {}), ErrorKind::kCheckpoint, "[5, 57]");  // too big
  EXPECT_SC_ERROR(CheckScaleShape(key, {576, 7168}, {280}, {}), ErrorKind::kCheckpoint, "[280]");
  EXPECT_SC_ERROR(CheckScaleShape(key, {8, 576, 7168}, {8, 5, 56}, {}), ErrorKind::kCheckpoint, "2-D",
                  "[8, 576, 7168]");
}

}  // namespace
}  // namespace shardcast
