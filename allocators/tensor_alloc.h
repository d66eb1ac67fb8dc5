// allocators/tensor_alloc: host allocators as at::Tensor factories.
//
// LazyZeroTensor returns a CPU tensor on a fresh lazy-zero mapping: it reads as zeros, commits no
// memory until written, and its deleter unmaps (storage is never recycled). Thread-safe.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>

#include "allocators/lazy_zero.h"

namespace shardcast {

at::Tensor LazyZeroTensor(at::IntArrayRef sizes, at::ScalarType dtype, const LazyZeroOptions& options = {});

}  // namespace shardcast
