#include "loaders/dtype.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>

namespace shardcast {
namespace {

TEST(DType, NamesRoundTripAndSizes) {
  for (int i = 0; i < kNumDTypes; ++i) {
    DType d = static_cast<DType>(i);
    auto parsed = ParseDType(DTypeName(d));
    ASSERT_TRUE(parsed.has_value()) << DTypeName(d);
    EXPECT_EQ(*parsed, d);
  }
  EXPECT_EQ(DTypeSize(DType::kBF16), 2u);
  EXPECT_EQ(DTypeSize(DType::kC64), 8u);
  EXPECT_EQ(DTypeSize(DType::kF8_E8M0), 1u);
  EXPECT_FALSE(ParseDType("F4").has_value());
  EXPECT_FALSE(ParseDType("bf16").has_value());  // names are case-sensitive
}

TEST(DType, OneFloatDTypeParserForEveryWayItIsNamed) {
  for (const char* name : {"bf16", "bfloat16", "BF16", "torch.bfloat16", "BFloat16"}) {
    EXPECT_EQ(ParseFloatDType(name), DType::kBF16) << name;
  }
  for (const char* name : {"f16", "fp16", "float16", "F16", "torch.float16"}) EXPECT_EQ(ParseFloatDType(name), DType::kF16) << name;
  for (const char* name : {"f32", "fp32", "float32", "F32", "torch.float32"}) EXPECT_EQ(ParseFloatDType(name), DType::kF32) << name;
  for (const char* name : {"", "F8_E4M3", "float64", "int8", "torch.", "bf16 ", "torch.torch.bfloat16"}) {
    EXPECT_FALSE(ParseFloatDType(name).has_value()) << name;
  }
}

TEST(DType, BFloat16RoundsToNearestEven) {
  EXPECT_EQ(FloatToBFloat16Bits(1.0f), 0x3F80);
  float halfway;  // 1 + 2^-8: exactly between 0x3F80 and 0x3F81 -> even (0x3F80)
  uint32_t u = 0x3F808000;
  std::memcpy(&halfway, &u, 4);
  EXPECT_EQ(FloatToBFloat16Bits(halfway), 0x3F80);
  u = 0x3F818000;  // between 0x3F81 and 0x3F82 -> even (0x3F82)
  std::memcpy(&halfway, &u, 4);
  EXPECT_EQ(FloatToBFloat16Bits(halfway), 0x3F82);
  EXPECT_EQ(FloatToBFloat16Bits(std::numeric_limits<float>::quiet_NaN()) & 0x7FC0, 0x7FC0);
  for (uint32_t h = 0; h < 0x10000; ++h) {
    float f = BFloat16BitsToFloat(static_cast<uint16_t>(h));
    if (std::isnan(f)) continue;
    ASSERT_EQ(FloatToBFloat16Bits(f), h) << std::hex << h;
  }
}

TEST(DType, HalfMatchesIeee) {
  EXPECT_EQ(FloatToHalfBits(1.0f), 0x3C00);
  EXPECT_EQ(FloatToHalfBits(-2.0f), 0xC000);
  EXPECT_EQ(FloatToHalfBits(65504.0f), 0x7BFF);
  EXPECT_EQ(FloatToHalfBits(65520.0f), 0x7C00);            // rounds to inf
  EXPECT_EQ(FloatToHalfBits(std::ldexp(1.0f, -24)), 0x0001);  // smallest subnormal
  EXPECT_EQ(FloatToHalfBits(std::ldexp(1.0f, -26)), 0x0000);  // underflows to zero
  EXPECT_EQ(FloatToHalfBits(std::numeric_limits<float>::quiet_NaN()), 0x7E00);
  for (uint32_t h = 0; h < 0x10000; ++h) {
    float f = HalfBitsToFloat(static_cast<uint16_t>(h));
    if (std::isnan(f)) continue;
    ASSERT_EQ(FloatToHalfBits(f), h) << std::hex << h;
  }
}

TEST(DType, ConvertElementsUnaligned) {
  EXPECT_TRUE(CanConvert(DType::kF32, DType::kBF16));
  EXPECT_TRUE(CanConvert(DType::kF8_E4M3, DType::kF8_E4M3));
  EXPECT_FALSE(CanConvert(DType::kF8_E4M3, DType::kBF16));
  EXPECT_FALSE(CanConvert(DType::kI32, DType::kF32));
  float src[3] = {1.5f, -0.25f, 3.0f};
  unsigned char raw[1 + sizeof(src)];
  std::memcpy(raw + 1, src, sizeof(src));
  unsigned char out[1 + 6];
  ConvertElements(DType::kF32, DType::kF16, raw + 1, out + 1, 3);
  uint16_t h[3];
  std::memcpy(h, out + 1, 6);
  EXPECT_EQ(h[0], 0x3E00);
  EXPECT_EQ(h[1], 0xB400);
  EXPECT_EQ(h[2], 0x4200);
  unsigned char back[1 + 6];
  ConvertElements(DType::kF16, DType::kBF16, out + 1, back + 1, 3);
  std::memcpy(h, back + 1, 6);
  EXPECT_EQ(h[0], FloatToBFloat16Bits(1.5f));
  EXPECT_EQ(h[2], FloatToBFloat16Bits(3.0f));
}

// Every fp8 byte against the formats' definitions (value = (-1)^s * 2^(e - bias) * 1.m, subnormals
// 2^(1 - bias) * 0.m) and the NaN bits torch gives.
TEST(DType, Fp8BytesDecodeToTheFormatsValues) {
  auto bits = [](float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    return u;
  };
  for (int b = 0; b < 256; ++b) {
    const float sign = b & 0x80 ? -1.0f : 1.0f;
    const int e4 = (b >> 3) & 0xF, m3 = b & 7;
    const float e4m3 = Fp8E4M3BitsToFloat(static_cast<uint8_t>(b));
    if ((b & 0x7F) == 0x7F) {
      EXPECT_EQ(bits(e4m3), b & 0x80 ? 0xFFF00000u : 0x7FF00000u);
    } else {
      const float want = sign * (e4 == 0 ? std::ldexp(float(m3), -9) : std::ldexp(float(8 + m3), e4 - 10));
      EXPECT_EQ(bits(e4m3), bits(want)) << "E4M3 0x" << std::hex << b;
    }
    const int e5 = (b >> 2) & 0x1F, m2 = b & 3;
    const float e5m2 = Fp8E5M2BitsToFloat(static_cast<uint8_t>(b));
    if (e5 == 31) {
      const uint32_t special = (b & 0x80 ? 0x80000000u : 0u) | 0x7F800000u | (m2 ? 0x400000u | (m2 << 21) : 0u);
      EXPECT_EQ(bits(e5m2), special) << "E5M2 0x" << std::hex << b;
    } else {
      const float want = sign * (e5 == 0 ? std::ldexp(float(m2), -16) : std::ldexp(float(4 + m2), e5 - 17));
      EXPECT_EQ(bits(e5m2), bits(want)) << "E5M2 0x" << std::hex << b;
    }
    const float e8m0 = Fp8E8M0BitsToFloat(static_cast<uint8_t>(b));
    if (b == 0xFF) {
      EXPECT_EQ(bits(e8m0), 0x7F800001u);  // torch's decoding: a signaling NaN
    } else {
      EXPECT_EQ(e8m0, std::ldexp(1.0f, b - 127)) << "E8M0 " << b;
    }
  }
  EXPECT_EQ(bits(Fp8E8M0BitsToFloat(0)), 0x00400000u);  // 2^-127 is a float denormal
  EXPECT_TRUE(IsFp8(DType::kF8_E4M3) && IsFp8(DType::kF8_E5M2) && IsFp8(DType::kF8_E8M0));
  EXPECT_FALSE(IsFp8(DType::kBF16) || IsFp8(DType::kU8));
}

}  // namespace
}  // namespace shardcast
