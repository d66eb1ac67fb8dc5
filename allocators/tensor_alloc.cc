#include "allocators/tensor_alloc.h"

#include <ATen/ops/from_blob.h>
#include <c10/util/irange.h>

namespace shardcast {

at::Tensor LazyZeroTensor(at::IntArrayRef sizes, at::ScalarType dtype, const LazyZeroOptions& options) {
  int64_t numel = 1;
  for (int64_t s : sizes) numel *= s;
  const size_t bytes = static_cast<size_t>(numel) * c10::elementSize(dtype);
  void* p = LazyZeroAllocate(bytes, options);
  if (p == nullptr) {
    // Zero bytes: from_blob still wants a pointer; a page of lazy-zero costs nothing.
    p = LazyZeroAllocate(1, options);
    return at::from_blob(p, sizes, [](void* q) { LazyZeroFree(q, 1); }, at::TensorOptions().dtype(dtype));
  }
  return at::from_blob(p, sizes, [bytes](void* q) { LazyZeroFree(q, bytes); }, at::TensorOptions().dtype(dtype));
}

}  // namespace shardcast
