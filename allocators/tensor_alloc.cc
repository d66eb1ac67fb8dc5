#include "allocators/tensor_alloc.h"

#include <ATen/ops/from_blob.h>
#include <c10/util/irange.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <utility>

namespace shardcast {

namespace {

struct Mapping;

// The live mappings by address, for LazyZeroOwner.
struct Registry {
  std::mutex mu;
  std::map<uintptr_t, std::pair<size_t, std::weak_ptr<Mapping>>> live;  // begin -> (bytes, owner)
};

Registry& Live() {
  static Registry* r = new Registry;  // never destroyed: mappings may outlive static destruction
  return *r;
}

// One lazy-zero mapping, unmapped by its last owner.
struct Mapping {
  void* p;
  size_t bytes;
  Mapping(void* p, size_t bytes) : p(p), bytes(bytes) {}
  Mapping(const Mapping&) = delete;
  Mapping& operator=(const Mapping&) = delete;
  ~Mapping() {
    {
      std::lock_guard<std::mutex> lock(Live().mu);
      auto it = Live().live.find(reinterpret_cast<uintptr_t>(p));
      if (it != Live().live.end() && it->second.second.expired()) Live().live.erase(it);
    }
    LazyZeroFree(p, bytes);
  }
};

}  // namespace

std::shared_ptr<const void> LazyZeroOwner(const void* p, size_t bytes) {
  const auto at = reinterpret_cast<uintptr_t>(p);
  std::lock_guard<std::mutex> lock(Live().mu);
  auto it = Live().live.upper_bound(at);
  if (it == Live().live.begin()) return nullptr;
  --it;
  if (at + bytes > it->first + it->second.first) return nullptr;
  return it->second.second.lock();
}

at::Tensor LazyZeroTensor(at::IntArrayRef sizes, at::ScalarType dtype, const LazyZeroOptions& options,
                          std::shared_ptr<const void>* mapping) {
  int64_t numel = 1;
  for (int64_t s : sizes) numel *= s;
  // Zero bytes: from_blob still wants a pointer; a page of lazy-zero costs nothing.
  const size_t bytes = std::max<size_t>(static_cast<size_t>(numel) * c10::elementSize(dtype), 1);
  void* p = LazyZeroAllocate(bytes, options);
  std::shared_ptr<Mapping> owner;
  try {
    owner = std::make_shared<Mapping>(p, bytes);
  } catch (...) {
    LazyZeroFree(p, bytes);
    throw;
  }
  {
    std::lock_guard<std::mutex> lock(Live().mu);
    Live().live[reinterpret_cast<uintptr_t>(p)] = {bytes, owner};  // may throw bad_alloc: owner unmaps
  }
  if (mapping != nullptr) *mapping = owner;
  return at::from_blob(p, sizes, [owner](void*) mutable { owner.reset(); }, at::TensorOptions().dtype(dtype));
}

}  // namespace shardcast
