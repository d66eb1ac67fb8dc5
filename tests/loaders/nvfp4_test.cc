#include "loaders/quant/nvfp4.h"
#include "loaders/quantization.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "allocators/error.h"
#include "tests/loaders/test_util.h"

namespace shardcast {
namespace {

// The rule written out from the format with exact double products, each rounded once to float:
// E2M1 by its bits (sign, 2-bit exponent with bias 1, 1-bit mantissa), the E4M3 scale by dtype.h.
uint32_t ReferenceBits(uint8_t nibble, uint8_t scale, float global, DType target) {
  const int e = (nibble >> 1) & 3, m = nibble & 1;
  const double mag = e == 0 ? 0.5 * m : std::ldexp(1.0 + 0.5 * m, e - 1);
  const float s = static_cast<float>(static_cast<double>(Fp8E4M3BitsToFloat(scale)) * global);
  const float v = static_cast<float>((nibble & 8 ? -mag : mag) * static_cast<double>(s));
  if (target == DType::kBF16) return FloatToBFloat16Bits(v);
  if (target == DType::kF16) return FloatToHalfBits(v);
  uint32_t u;
  std::memcpy(&u, &v, 4);
  return u;
}

float AsFloat(uint32_t bits, DType t) {
  if (t == DType::kBF16) return BFloat16BitsToFloat(static_cast<uint16_t>(bits));
  if (t == DType::kF16) return HalfBitsToFloat(static_cast<uint16_t>(bits));
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

TEST(Nvfp4, HandComputedBlocks) {
  // Two rows of 32 values: row 0 scales 1.0 (0x38) and 2.0 (0x40), row 1 scale 0.5 (0x30) and 448
  // (0x7E); global 0.5. Byte 0 = 0x72: values 1.0 (nibble 2) and 6.0 (nibble 7); byte 1 = 0x9F:
  // -6 and -0.5.
  std::vector<uint8_t> values(32, 0), scales = {0x38, 0x40, 0x30, 0x7E};
  values[0] = 0x72;
  values[1] = 0x9F;
  values[8] = 0x11;   // row 0, block 1: 0.5, 0.5 (x 2 x 0.5 = 0.5)
  values[16] = 0x07;  // row 1, block 0: 6 and 0 (x 0.5 x 0.5 = 1.5)
  values[24] = 0x0D;  // row 1, block 1: -3 (x 448 x 0.5 = -672)
  std::vector<float> out(64, -1.0f);
  DequantizeNvfp4(Nvfp4Matrix{values.data(), scales.data(), 0.5f, 0, 32}, {{0, 2}, {0, 32}}, DType::kF32,
                  WindowOut{out.data()});
  EXPECT_EQ(out[0], 0.5f);
  EXPECT_EQ(out[1], 3.0f);
  EXPECT_EQ(out[2], -3.0f);
  EXPECT_EQ(out[3], -0.25f);
  EXPECT_EQ(out[16], 0.5f);
  EXPECT_EQ(out[17], 0.5f);
  EXPECT_EQ(out[32], 1.5f);
  EXPECT_EQ(out[33], 0.0f);
  EXPECT_EQ(out[48], -672.0f);
  EXPECT_TRUE(std::signbit(out[4]) == false && out[4] == 0.0f);
}

TEST(Nvfp4, EveryScaleEveryNibbleEqualsTheRule) {
  // 256 rows, row s with E4M3 scale byte s (NaN, subnormals and 448 included), each byte 0..255 once
  // per row (every nibble pair); globals that round the scale product.
  const uint64_t cols = 512;
  std::vector<uint8_t> values(256 * cols / 2), scales(256 * cols / 16);
  for (uint64_t r = 0; r < 256; ++r) {
    for (uint64_t j = 0; j < cols / 2; ++j) values[r * cols / 2 + j] = static_cast<uint8_t>(j);
    for (uint64_t b = 0; b < cols / 16; ++b) scales[r * cols / 16 + b] = static_cast<uint8_t>(r);
  }
  for (dequant_internal::Isa isa : dequant_internal::SupportedIsas()) {  // every kernel this CPU runs
  for (float global : {1.0f, 0.3f, 1.7e-3f, 2.5e4f}) {
    for (DType t : {DType::kBF16, DType::kF16, DType::kF32}) {
      // an odd window, with a row stride
      const OutputWindow w{{3, 250}, {5, 501}};
      const uint64_t stride = w.cols.size() + 3;
      std::vector<unsigned char> out(w.rows.size() * stride * 4);
      const Nvfp4Matrix m{values.data() + 3 * cols / 2, scales.data() + 3 * cols / 16, global, 3, cols};
      nvfp4_internal::DequantizeWithIsa(isa, m, w, t, WindowOut{out.data(), stride});
      uint64_t bad = 0;
      for (uint64_t r = w.rows.begin; r < w.rows.end; ++r) {
        for (uint64_t c = w.cols.begin; c < w.cols.end; ++c) {
          const uint8_t byte = values[r * cols / 2 + c / 2];
          const uint32_t want = ReferenceBits(c % 2 ? byte >> 4 : byte & 0x0F, static_cast<uint8_t>(r), global, t);
          uint32_t got = 0;
          std::memcpy(&got, out.data() + ((r - w.rows.begin) * stride + c - w.cols.begin) * DTypeSize(t), DTypeSize(t));
          // a NaN scale (E4M3 0x7F, 0xFF) gives NaN; its payload is the conversion's business
          const bool both_nan = std::isnan(AsFloat(want, t)) && std::isnan(AsFloat(got, t));
          if (got != want && !both_nan && bad++ < 3) {
            ADD_FAILURE() << dequant_internal::IsaName(isa) << " " << DTypeName(t) << " global " << global << " [" << r << ", " << c << "]: got 0x" << std::hex
                          << got << " want 0x" << want;
          }
        }
      }
      EXPECT_EQ(bad, 0u);
    }
  }
  }
}

// A stored matrix [rows, cols] of random values and E4M3 scales 0x20-0x5f (finite, positive).
struct RandomNvfp4 {
  uint64_t rows, cols;
  std::vector<uint8_t> values, scales;
  RandomNvfp4(uint64_t r, uint64_t c, uint32_t seed) : rows(r), cols(c), values(r * c / 2), scales(r * c / 16) {
    std::mt19937 rng(seed);
    for (auto& b : values) b = static_cast<uint8_t>(rng());
    for (auto& b : scales) b = static_cast<uint8_t>(0x20 + rng() % 0x40);
  }
  // Runs window `w` and counts its elements that differ from the rule.
  uint64_t Mismatches(dequant_internal::Isa isa, float global, DType t, OutputWindow w) const {
    const size_t ts = DTypeSize(t);
    std::vector<unsigned char> out(w.rows.size() * w.cols.size() * ts, 0xAB);
    const Nvfp4Matrix m{values.data(), scales.data(), global, 0, cols};
    nvfp4_internal::DequantizeWithIsa(isa, m, w, t, WindowOut{out.data()});
    uint64_t bad = 0;
    for (uint64_t r = w.rows.begin; r < w.rows.end; ++r) {
      for (uint64_t c = w.cols.begin; c < w.cols.end; ++c) {
        const uint8_t byte = values[r * cols / 2 + c / 2];
        const uint32_t want = ReferenceBits(c % 2 ? byte >> 4 : byte & 0x0F, scales[r * cols / 16 + c / 16], global, t);
        uint32_t got = 0;
        std::memcpy(&got, out.data() + ((r - w.rows.begin) * w.cols.size() + c - w.cols.begin) * ts, ts);
        bad += got != want;
      }
    }
    return bad;
  }
};

TEST(Nvfp4, CachedTablesFollowTheGlobalScaleAndTheTarget) {
  // Windows of one matrix with globals and targets interleaved, more keys than the cache holds and
  // keys coming back after they were evicted: every window must use its own key's tables.
  const RandomNvfp4 m(40, 96, 3);
  const float globals[] = {1.0f / 2688, 0.75f, 1.0f / 2688, 3.0f, -0.5f, 1e-3f, 0.75f, 1.0f / 2688};
  for (dequant_internal::Isa isa : dequant_internal::SupportedIsas()) {
    for (int round = 0; round < 2; ++round) {
      for (float g : globals) {
        for (DType t : {DType::kBF16, DType::kF16, DType::kF32, DType::kBF16}) {
          EXPECT_EQ(m.Mismatches(isa, g, t, {{3, 19}, {16, 80}}), 0u)
              << dequant_internal::IsaName(isa) << " " << DTypeName(t) << " global " << g;
          EXPECT_EQ(m.Mismatches(isa, g, t, {{20, 21}, {5, 91}}), 0u)
              << dequant_internal::IsaName(isa) << " " << DTypeName(t) << " global " << g << " (cut row)";
        }
      }
    }
  }
}

TEST(Nvfp4, RepeatedWindowsBuildTheirTablesOnce) {
  // The tables of the last 4 (global scale, target) keys a thread used are kept, whatever the ISA.
  const RandomNvfp4 m(32, 64, 4);
  const auto isas = dequant_internal::SupportedIsas();
  const float g1 = 0.0123f, g2 = 0.0456f;  // keys no other test uses
  const uint64_t before = nvfp4_internal::TablesBuilt();
  for (int i = 0; i < 50; ++i) EXPECT_EQ(m.Mismatches(isas[i % isas.size()], g1, DType::kBF16, {{0, 16}, {0, 64}}), 0u);
  EXPECT_EQ(nvfp4_internal::TablesBuilt() - before, 1u);
  // four keys in turn: each built once
  const std::pair<float, DType> four[] = {{g1, DType::kBF16}, {g1, DType::kF32}, {g2, DType::kBF16}, {g2, DType::kF16}};
  for (int round = 0; round < 3; ++round) {
    for (const auto& [g, t] : four) EXPECT_EQ(m.Mismatches(isas.back(), g, t, {{16, 32}, {0, 64}}), 0u);
  }
  EXPECT_EQ(nvfp4_internal::TablesBuilt() - before, 4u);
  // a fifth evicts the least recently used, (g1, BF16), which is then built again
  EXPECT_EQ(m.Mismatches(isas.back(), g2, DType::kF32, {{0, 1}, {0, 64}}), 0u);
  EXPECT_EQ(m.Mismatches(isas.back(), g2, DType::kF16, {{0, 1}, {0, 64}}), 0u);
  EXPECT_EQ(nvfp4_internal::TablesBuilt() - before, 5u);
  EXPECT_EQ(m.Mismatches(isas.back(), g1, DType::kBF16, {{0, 1}, {0, 64}}), 0u);
  EXPECT_EQ(nvfp4_internal::TablesBuilt() - before, 6u);
}

TEST(Nvfp4, RefusesWhatDoesNotPair) {
  const std::string key = "model.layers.0.mlp.up_proj.weight";
  EXPECT_NO_THROW(CheckNvfp4Triple(key, DType::kU8, {64, 16}, DType::kF8_E4M3, {64, 2}, DType::kF32, {}));
  EXPECT_SC_ERROR(CheckNvfp4Triple(key, DType::kU8, {64, 16}, DType::kF8_E4M3, {64, 3}, DType::kF32, {}),
                  ErrorKind::kCheckpoint, "'model.layers.0.mlp.up_proj.weight_scale' F8_E4M3 [64, 3]", "[64, 16]");
  EXPECT_SC_ERROR(CheckNvfp4Triple(key, DType::kU8, {64, 16}, DType::kF8_E4M3, {64, 2}, DType::kF32, {2}),
                  ErrorKind::kCheckpoint, "weight_scale_2' F32 [2]");
  std::vector<uint8_t> v(8), s(1);
  std::vector<uint16_t> out(16);
  EXPECT_SC_ERROR(DequantizeNvfp4(Nvfp4Matrix{v.data(), s.data(), 1.0f, 0, 16}, {{0, 1}, {0, 17}}, DType::kBF16,
                                  WindowOut{out.data()}),
                  ErrorKind::kInvalidArgument, "not within");
}

TEST(Nvfp4, ModelOptIsReadOnlyForItsNvfp4Algorithms) {
  auto config = [](const std::string& q) { return R"({"model_type":"llama","quantization_config":)" + q + "}"; };
  EXPECT_NO_THROW(CheckQuantMethod("c.json", config(R"({"quant_method":"modelopt","quant_algo":"NVFP4"})")));
  EXPECT_NO_THROW(CheckQuantMethod("c.json", config(R"({"quant_method":"modelopt","quant_algo":"W4A16_NVFP4"})")));
  EXPECT_NO_THROW(CheckQuantMethod("c.json", config(R"({"quant_method":"fp8"})")));
  EXPECT_NO_THROW(CheckQuantMethod("c.json", config(R"({"quant_method":"mxfp4"})")));
  // ModelOpt's FP8 has per-tensor scales shardcast does not pair: refused up front, not later by a key.
  EXPECT_SC_ERROR(CheckQuantMethod("c.json", config(R"({"quant_method":"modelopt","quant_algo":"FP8"})")),
                  ErrorKind::kCheckpoint, "quant_algo \"FP8\" of quant_method modelopt");
  EXPECT_SC_ERROR(CheckQuantMethod("c.json", config(R"({"quant_method":"modelopt"})")), ErrorKind::kCheckpoint,
                  "quant_algo \"(none)\"");
  EXPECT_SC_ERROR(CheckQuantMethod("c.json", config(R"({"quant_method":"gptq"})")), ErrorKind::kCheckpoint,
                  "\"gptq\" is not one shardcast reads");
}

}  // namespace
}  // namespace shardcast
