// loaders/shape: a tensor shape as the error messages name it, and its element count. One place for
// both, so that every message prints a shape the same way ("[2, 3]"; "[]" for a scalar).
// Thread-safe: pure functions.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace shardcast {

std::string ShapeText(const std::vector<uint64_t>& shape);
// The product of the dims (1 for a scalar), wrapping on overflow: callers that may overflow check first.
uint64_t Numel(const std::vector<uint64_t>& shape);

}  // namespace shardcast
