// loaders/dtype: the safetensors dtype table and element conversions.
//
// Names are exactly the safetensors header strings. Sizes are whole bytes; sub-byte types (F4, F6_*)
// are not supported and are rejected by name. Thread-safe: everything here is pure.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace shardcast {

enum class DType : uint8_t {
  kBool, kU8, kI8, kI16, kU16, kI32, kU32, kI64, kU64,
  kF16, kBF16, kF32, kF64, kF8_E4M3, kF8_E5M2, kF8_E8M0, kC64,
};
inline constexpr int kNumDTypes = 17;

std::string_view DTypeName(DType dtype);
size_t DTypeSize(DType dtype);                     // bytes per element
std::optional<DType> ParseDType(std::string_view name);
// The one parser of a floating dtype a user or a config names: "bf16", "bfloat16", "BF16",
// "torch.bfloat16" (and f16/fp16/float16, f32/fp32/float32), any case; nullopt for anything else.
std::optional<DType> ParseFloatDType(std::string_view name);
bool IsFloatingPoint(DType dtype);                 // F16, BF16, F32, F64, F8_*
bool IsFp8(DType dtype);                           // F8_E4M3, F8_E5M2, F8_E8M0

// Element conversion between floating dtypes, round-to-nearest-even, NaN stays NaN, the same bits
// as torch's Tensor.to(). Supported pairs: any of {F16, BF16, F32}, and identity for every dtype
// (fp8 passes through unchanged; it is never converted).
bool CanConvert(DType from, DType to);
// REQUIRES: CanConvert(from, to); src holds n elements of `from`, dst room for n of `to`.
// src and dst need no alignment.
void ConvertElements(DType from, DType to, const void* src, void* dst, size_t n);

uint16_t FloatToBFloat16Bits(float f);
float BFloat16BitsToFloat(uint16_t h);
uint16_t FloatToHalfBits(float f);
float HalfBitsToFloat(uint16_t h);

// One fp8 byte as float: the bits torch's Tensor.float() gives on CPU, NaN payloads included.
//   F8_E4M3 (torch.float8_e4m3fn): no infinities; 0x7F / 0xFF are NaN, 0x7FF00000 / 0xFFF00000.
//   F8_E5M2 (torch.float8_e5m2): the top byte of an IEEE half; inf stays inf, a NaN is quieted with
//     its payload kept (0x7D -> 0x7FE00000, 0x7E -> 0x7FC00000).
//   F8_E8M0 (torch.float8_e8m0fnu): 2^(e - 127), exactly, so e = 0 is the float denormal 2^-127
//     (0x00400000); 0xFF is NaN, which torch decodes as the *signaling* 0x7F800001.
float Fp8E4M3BitsToFloat(uint8_t b);
float Fp8E5M2BitsToFloat(uint8_t b);
float Fp8E8M0BitsToFloat(uint8_t b);

}  // namespace shardcast
