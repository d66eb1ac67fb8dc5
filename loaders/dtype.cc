#include "loaders/dtype.h"

#include <cctype>
#include <cmath>
#include <cstring>

namespace shardcast {
namespace {

struct DTypeInfo {
  DType dtype;
  std::string_view name;
  size_t size;
  bool floating;
};

constexpr DTypeInfo kTable[kNumDTypes] = {
    {DType::kBool, "BOOL", 1, false},     {DType::kU8, "U8", 1, false},
    {DType::kI8, "I8", 1, false},         {DType::kI16, "I16", 2, false},
    {DType::kU16, "U16", 2, false},       {DType::kI32, "I32", 4, false},
    {DType::kU32, "U32", 4, false},       {DType::kI64, "I64", 8, false},
    {DType::kU64, "U64", 8, false},       {DType::kF16, "F16", 2, true},
    {DType::kBF16, "BF16", 2, true},      {DType::kF32, "F32", 4, true},
    {DType::kF64, "F64", 8, true},        {DType::kF8_E4M3, "F8_E4M3", 1, true},
    {DType::kF8_E5M2, "F8_E5M2", 1, true}, {DType::kF8_E8M0, "F8_E8M0", 1, true},
    {DType::kC64, "C64", 8, false},
};

uint32_t FloatBits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
float BitsFloat(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

bool IsConvertibleFloat(DType d) {
  return d == DType::kF16 || d == DType::kBF16 || d == DType::kF32;
}

float LoadAsFloat(DType d, const unsigned char* p) {
  if (d == DType::kF32) {
    float f;
    std::memcpy(&f, p, 4);
    return f;
  }
  uint16_t h;
  std::memcpy(&h, p, 2);
  return d == DType::kBF16 ? BFloat16BitsToFloat(h) : HalfBitsToFloat(h);
}

void StoreFromFloat(DType d, float f, unsigned char* p) {
  if (d == DType::kF32) {
    std::memcpy(p, &f, 4);
    return;
  }
  uint16_t h = d == DType::kBF16 ? FloatToBFloat16Bits(f) : FloatToHalfBits(f);
  std::memcpy(p, &h, 2);
}

}  // namespace

std::string_view DTypeName(DType dtype) { return kTable[static_cast<int>(dtype)].name; }
size_t DTypeSize(DType dtype) { return kTable[static_cast<int>(dtype)].size; }
bool IsFloatingPoint(DType dtype) { return kTable[static_cast<int>(dtype)].floating; }
bool IsFp8(DType dtype) {
  return dtype == DType::kF8_E4M3 || dtype == DType::kF8_E5M2 || dtype == DType::kF8_E8M0;
}

std::optional<DType> ParseDType(std::string_view name) {
  for (const auto& info : kTable) {
    if (info.name == name) return info.dtype;
  }
  return std::nullopt;
}

std::optional<DType> ParseFloatDType(std::string_view name) {
  std::string t;
  for (char c : name) t += static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  if (t.rfind("torch.", 0) == 0) t.erase(0, 6);
  if (t == "bf16" || t == "bfloat16") return DType::kBF16;
  if (t == "f16" || t == "fp16" || t == "float16") return DType::kF16;
  if (t == "f32" || t == "fp32" || t == "float32") return DType::kF32;
  return std::nullopt;
}

// bf16 is the top half of an f32; rounding adds 0x7FFF plus the lowest kept bit (ties to even).
uint16_t FloatToBFloat16Bits(float f) {
  if (std::isnan(f)) return 0x7FC0;
  uint32_t u = FloatBits(f);
  uint32_t rounding_bias = ((u >> 16) & 1) + 0x7FFF;
  return static_cast<uint16_t>((u + rounding_bias) >> 16);
}

float BFloat16BitsToFloat(uint16_t h) { return BitsFloat(static_cast<uint32_t>(h) << 16); }

// IEEE half from float by letting the FPU round: scale so the half's mantissa lands in the float's
// low bits, add a bias that fixes the exponent, then read the bits back (the method c10 uses).
uint16_t FloatToHalfBits(float f) {
  const float scale_to_inf = BitsFloat(0x77800000);   // 2^112
  const float scale_to_zero = BitsFloat(0x08800000);  // 2^-110
  float base = (std::fabs(f) * scale_to_inf) * scale_to_zero;
  const uint32_t w = FloatBits(f);
  const uint32_t shl1_w = w + w;
  const uint32_t sign = w & 0x80000000u;
  uint32_t bias = shl1_w & 0xFF000000u;
  if (bias < 0x71000000u) bias = 0x71000000u;
  base = BitsFloat((bias >> 1) + 0x07800000u) + base;
  const uint32_t bits = FloatBits(base);
  const uint32_t exp_bits = (bits >> 13) & 0x00007C00u;
  const uint32_t mantissa_bits = bits & 0x00000FFFu;
  const uint32_t nonsign = exp_bits + mantissa_bits;
  return static_cast<uint16_t>((sign >> 16) | (shl1_w > 0xFF000000u ? 0x7E00u : nonsign));
}

float HalfBitsToFloat(uint16_t h) {
  const uint32_t w = static_cast<uint32_t>(h) << 16;
  const uint32_t sign = w & 0x80000000u;
  const uint32_t two_w = w + w;
  const uint32_t exp_offset = 0xE0u << 23;
  const float exp_scale = BitsFloat(0x07800000);  // 2^-112
  const float normalized = BitsFloat((two_w >> 4) + exp_offset) * exp_scale;
  const uint32_t magic_mask = 126u << 23;
  const float denormalized = BitsFloat((two_w >> 17) | magic_mask) - 0.5f;
  const uint32_t denormalized_cutoff = 1u << 27;
  const uint32_t result =
      sign | (two_w < denormalized_cutoff ? FloatBits(denormalized) : FloatBits(normalized));
  return BitsFloat(result);
}

// e4m3fn: bias 7, subnormals m * 2^-9, exponent field 15 holds normals except mantissa 7 (NaN).
float Fp8E4M3BitsToFloat(uint8_t b) {
  const uint32_t sign = static_cast<uint32_t>(b & 0x80) << 24;
  const uint32_t exp = (b >> 3) & 0xF, mant = b & 0x7;
  if (exp == 0xF && mant == 0x7) return BitsFloat(sign | 0x7FF00000u);
  if (exp == 0) return BitsFloat(sign | FloatBits(std::ldexp(static_cast<float>(mant), -9)));
  return BitsFloat(sign | ((exp + 120) << 23) | (mant << 20));
}

float Fp8E5M2BitsToFloat(uint8_t b) { return HalfBitsToFloat(static_cast<uint16_t>(b << 8)); }

float Fp8E8M0BitsToFloat(uint8_t b) {
  if (b == 0xFF) return BitsFloat(0x7F800001u);
  if (b == 0) return BitsFloat(0x00400000u);  // 2^-127, a denormal; every other e is a normal's exponent
  return BitsFloat(static_cast<uint32_t>(b) << 23);
}

bool CanConvert(DType from, DType to) {
  return from == to || (IsConvertibleFloat(from) && IsConvertibleFloat(to));
}

void ConvertElements(DType from, DType to, const void* src, void* dst, size_t n) {
  if (from == to) {
    std::memcpy(dst, src, n * DTypeSize(from));
    return;
  }
  const auto* s = static_cast<const unsigned char*>(src);
  auto* d = static_cast<unsigned char*>(dst);
  const size_t ss = DTypeSize(from), ds = DTypeSize(to);
  for (size_t i = 0; i < n; ++i) StoreFromFloat(to, LoadAsFloat(from, s + i * ss), d + i * ds);
}

}  // namespace shardcast
