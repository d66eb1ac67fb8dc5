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
bool IsFloatingPoint(DType dtype);                 // F16, BF16, F32, F64, F8_*

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

}  // namespace shardcast
