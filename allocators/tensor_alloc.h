// allocators/tensor_alloc: host allocators as at::Tensor factories.
//
// LazyZeroTensor returns a CPU tensor on a fresh lazy-zero mapping: it reads as zeros, commits no
// memory until written, and its deleter unmaps (storage is never recycled). Thread-safe.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>

#include <memory>

#include "allocators/lazy_zero.h"

namespace shardcast {

// `mapping`, where given, gets an owner of the mapping under the tensor: it stays mapped while any owner
// lives (the tensor's deleter holds one), however the tensor's storage is later freed, resized or swapped.
// Its last holder unmaps, with no c10 or Python object involved: a thread of no interpreter may hold it.
at::Tensor LazyZeroTensor(at::IntArrayRef sizes, at::ScalarType dtype, const LazyZeroOptions& options = {},
                          std::shared_ptr<const void>* mapping = nullptr);

// An owner of the live LazyZeroTensor mapping that holds all of [p, p + bytes), as `mapping` above; null
// where none does (memory of another allocator, or a mapping already unmapped). For tensors made elsewhere
// (Python's `lazy_zero_tensor`) and handed over.
std::shared_ptr<const void> LazyZeroOwner(const void* p, size_t bytes);

}  // namespace shardcast
