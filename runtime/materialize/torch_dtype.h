// runtime/materialize/torch_dtype: safetensors dtypes <-> at::ScalarType. Thread-safe, pure.
#pragma once

#include <c10/core/ScalarType.h>

#include <optional>

#include "loaders/dtype.h"

namespace shardcast {

// Throws kUnsupported naming the dtype where this torch has no matching type (e.g. F8_E8M0 < 2.7).
at::ScalarType ToScalarType(DType dtype);
std::optional<DType> FromScalarType(at::ScalarType type);

}  // namespace shardcast
