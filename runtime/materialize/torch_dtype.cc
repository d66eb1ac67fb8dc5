#include "runtime/materialize/torch_dtype.h"

#if __has_include(<torch/headeronly/version.h>)
#include <torch/headeronly/version.h>  // torch >= 2.9
#else
#include <torch/version.h>             // torch/csrc/api/include, older wheels
#endif

#include <string>

#include "allocators/error.h"

#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 7)
#define SHARDCAST_TORCH_HAS_E8M0 1
#else
#define SHARDCAST_TORCH_HAS_E8M0 0
#endif

namespace shardcast {

at::ScalarType ToScalarType(DType dtype) {
  switch (dtype) {
    case DType::kBool: return at::kBool;
    case DType::kU8: return at::kByte;
    case DType::kI8: return at::kChar;
    case DType::kI16: return at::kShort;
    case DType::kU16: return at::kUInt16;
    case DType::kI32: return at::kInt;
    case DType::kU32: return at::kUInt32;
    case DType::kI64: return at::kLong;
    case DType::kU64: return at::kUInt64;
    case DType::kF16: return at::kHalf;
    case DType::kBF16: return at::kBFloat16;
    case DType::kF32: return at::kFloat;
    case DType::kF64: return at::kDouble;
    case DType::kF8_E4M3: return at::kFloat8_e4m3fn;
    case DType::kF8_E5M2: return at::kFloat8_e5m2;
    case DType::kF8_E8M0:
#if SHARDCAST_TORCH_HAS_E8M0
      return at::ScalarType::Float8_e8m0fnu;
#else
      break;
#endif
    case DType::kC64: return at::kComplexFloat;
  }
  throw Error(ErrorKind::kUnsupported, std::string(DTypeName(dtype)),
              "this torch (" TORCH_VERSION ") has no matching scalar type");
}

std::optional<DType> FromScalarType(at::ScalarType type) {
  for (int i = 0; i < kNumDTypes; ++i) {
    DType d = static_cast<DType>(i);
    try {
      if (ToScalarType(d) == type) return d;
    } catch (const Error&) {
    }
  }
  return std::nullopt;
}

}  // namespace shardcast
