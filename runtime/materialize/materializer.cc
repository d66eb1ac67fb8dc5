#include "runtime/materialize/materializer.h"

#include <ATen/ATen.h>
#include <dlfcn.h>
#include <link.h>

#include <memory>
#include <string>
#include <nlohmann/json.hpp>

#include "allocators/error.h"
#include "allocators/pinned.h"
#include "allocators/tensor_alloc.h"
#include "runtime/materialize/buffer_init.h"
#include "runtime/materialize/torch_dtype.h"

namespace shardcast {
namespace {

std::vector<int64_t> Sizes(const std::vector<uint64_t>& shape) { return std::vector<int64_t>(shape.begin(), shape.end()); }

at::Tensor PinnedZeroTensor(at::IntArrayRef sizes, at::ScalarType dtype) {
  int64_t numel = 1;
  for (int64_t s : sizes) numel *= s;
  size_t bytes = static_cast<size_t>(numel) * c10::elementSize(dtype);
  auto buffer = std::make_shared<PinnedBuffer>(PinnedBuffer::Allocate(std::max<size_t>(bytes, 1)));
  std::memset(buffer->data(), 0, bytes);  // pinned memory is committed anyway; zero it explicitly
  return at::from_blob(buffer->data(), sizes, [buffer](void*) mutable { buffer.reset(); },
                       at::TensorOptions().dtype(dtype));
}

// ATen's CUDA kernels register when libtorch_cuda loads. Python's `import torch` loads it; a C++ program
// (the CLI, the API's users) links it only by name, which an --as-needed linker drops (nothing calls into
// it by symbol), and linking it always would cost every process 0.5 s and ~360 MB of mapped pages. So the
// first CUDA target loads it here, beside the libtorch_cpu this process runs on. A torch without CUDA has
// none: kUnsupported saying so (ATen's own error is the dispatcher's dump).
void LoadTorchCuda() {
  static const std::string failed = []() -> std::string {
    if (dlopen("libtorch_cuda.so", RTLD_NOW | RTLD_GLOBAL | RTLD_NOLOAD) != nullptr) return "";
    std::string dir;
    dl_iterate_phdr(
        [](struct dl_phdr_info* info, size_t, void* out) {
          const std::string name = info->dlpi_name ? info->dlpi_name : "";
          const size_t slash = name.rfind('/');
          if (slash != std::string::npos && name.compare(slash + 1, std::string::npos, "libtorch_cpu.so") == 0) {
            *static_cast<std::string*>(out) = name.substr(0, slash + 1);
            return 1;
          }
          return 0;
        },
        &dir);
    std::string why;
    for (const std::string& name : {dir.empty() ? std::string() : dir + "libtorch_cuda.so", std::string("libtorch_cuda.so")}) {
      if (name.empty()) continue;
      if (dlopen(name.c_str(), RTLD_NOW | RTLD_GLOBAL) != nullptr) return "";
      const char* e = dlerror();
      why = e ? e : name + ": not loaded";
    }
    return why.empty() ? std::string("libtorch_cuda.so: not found") : why;
  }();
  if (!failed.empty()) {
    throw Error(ErrorKind::kUnsupported, "target cuda",
                "this process's torch has no CUDA backend to load (" + failed + "): a CPU build of torch, or its "
                "CUDA libraries are missing");
  }
}

}  // namespace

at::Tensor AllocateZeroed(at::IntArrayRef sizes, at::ScalarType dtype, Target target, const PrepareOptions& options) {
  switch (target) {
    case Target::kCpu:
      return LazyZeroTensor(sizes, dtype, options.host);
    case Target::kPinned:
      return PinnedZeroTensor(sizes, dtype);
    case Target::kCuda:
      LoadTorchCuda();
      try {
        return at::zeros(sizes, at::TensorOptions().dtype(dtype).device(at::Device(at::kCUDA, options.device_index)));
      } catch (const c10::Error& e) {
        throw Error(ErrorKind::kUnsupported, "target cuda",
                    "cannot allocate on cuda:" + std::to_string(options.device_index) + ": " + e.what_without_backtrace());
      }
  }
  throw Error(ErrorKind::kInternal, "materializer", "unknown target");
}

RankState RankState::Prepare(const Plan& plan, int rank, const PrepareOptions& options) {
  plan.CheckRank(rank);
  const ModelSpec& spec = plan.spec();
  RankState s;
  s.plan_ = &plan;
  s.rank_ = rank;
  s.options_ = options;
  s.report_.rank = rank;
  s.report_.world_size = plan.world_size();
  s.report_.target = options.target;
  const nlohmann::json config = nlohmann::json::parse(spec.config_json);
  s.tensors_.reserve(plan.entries().size());
  for (const PlanEntry& e : plan.entries()) {
    LocalTensor t;
    t.entry = &e;
    t.local_shape = e.LocalShape(rank);
    switch (e.role) {
      case Role::kParameter:
      case Role::kSidecar: {
        t.from_checkpoint = true;  // t.tensor stays undefined: meta without a TensorImpl per entry
        ++s.report_.meta_entries;
        const uint64_t n = e.PieceOf(rank).numel();
        s.report_.shard_bytes += n * DTypeSize(e.dtype);
        if (!e.replicated() && n == 0) ++s.report_.entries_without_rows;
        break;
      }
      case Role::kPersistentBuffer:
        t.tensor = AllocateZeroed(Sizes(e.shape), ToScalarType(e.dtype), options.target, options);
        t.from_checkpoint = true;
        ++s.report_.persistent_buffers;
        s.report_.buffer_bytes += e.nbytes();
        break;
      case Role::kNonPersistentBuffer: {
        const std::vector<int64_t> local = Sizes(e.shape);
        const at::ScalarType dtype = ToScalarType(e.dtype);
        at::Tensor host = LazyZeroTensor(local, dtype);
        try {
          t.note = BufferInitRegistry::Global().Run(BufferInitContext{config, spec.source, e.key},
                                                    std::string(e.init_rule), host);
        } catch (const Error& err) {
          const std::string what = err.what();
          if (what.compare(0, e.key.size(), e.key) == 0) throw;
          throw Error(err.kind(), e.key, what);  // name the buffer, then the rule's own cause
        }
        t.tensor = options.target == Target::kCpu ? host : AllocateZeroed(local, dtype, options.target, options);
        if (options.target != Target::kCpu) t.tensor.copy_(host);
        s.report_.notes.push_back(e.key + ": " + t.note);
        ++s.report_.computed_buffers;
        s.report_.buffer_bytes += e.nbytes();
        break;
      }
    }
    s.tensors_.push_back(std::move(t));
  }
  return s;
}

RankState RankState::Adopt(const Plan& plan, int rank, std::vector<at::Tensor> tensors) {
  plan.CheckRank(rank);
  if (tensors.size() != plan.entries().size()) {
    throw Error(ErrorKind::kInternal, "adopt", std::to_string(tensors.size()) + " tensors for " +
                                                   std::to_string(plan.entries().size()) + " entries");
  }
  RankState s;
  s.plan_ = &plan;
  s.rank_ = rank;
  s.report_.rank = rank;
  s.report_.world_size = plan.world_size();
  for (size_t i = 0; i < tensors.size(); ++i) {
    const PlanEntry& e = plan.entries()[i];
    at::Tensor& x = tensors[i];
    const std::vector<uint64_t> local_shape = e.LocalShape(rank);
    std::vector<int64_t> want = Sizes(local_shape);
    const std::string where = "key '" + e.key + "' on rank " + std::to_string(rank);
    if (!x.defined() || x.is_meta()) {
      throw Error(ErrorKind::kInvalidArgument, where, "has no storage (still on meta: call to_empty first)");
    }
    if (x.sizes().vec() != want) {
      auto text = [](at::IntArrayRef v) {
        std::string out;
        for (int64_t d : v) out += (out.empty() ? "" : ", ") + std::to_string(d);
        return "[" + out + "]";
      };
      throw Error(ErrorKind::kInvalidArgument, where,
                  "local tensor has shape " + text(x.sizes()) + " but its layout gives " + text(want) + " (" +
                      e.layout->Text() + ")");
    }
    if (x.scalar_type() != ToScalarType(e.dtype)) {
      throw Error(ErrorKind::kInvalidArgument, where, "local tensor dtype differs from the plan's");
    }
    if (!x.is_contiguous()) throw Error(ErrorKind::kInvalidArgument, where, "local tensor is not contiguous");
    LocalTensor t;
    t.entry = &e;
    t.local_shape = local_shape;
    t.tensor = x;
    t.from_checkpoint = e.role != Role::kNonPersistentBuffer;
    s.tensors_.push_back(std::move(t));
  }
  return s;
}

void RankState::AllocateShards() {
  for (LocalTensor& t : tensors_) {
    if (!t.is_meta()) continue;
    t.tensor = options_.target == Target::kCpu
                   ? LazyZeroTensor(Sizes(t.local_shape), ToScalarType(t.entry->dtype), options_.host, &t.mapping)
                   : AllocateZeroed(Sizes(t.local_shape), ToScalarType(t.entry->dtype), options_.target, options_);
  }
}

at::Tensor LocalTensor::MetaTensor() const {
  std::vector<int64_t> sizes = Sizes(local_shape);
  return at::empty(sizes, at::TensorOptions().dtype(ToScalarType(entry->dtype)).device(at::kMeta));
}

LocalTensor* RankState::Find(const std::string& key) {
  size_t cursor = 0;
  return FindNext(key, &cursor);
}

LocalTensor* RankState::FindNext(std::string_view key, size_t* cursor) {
  // tensors_ holds one entry per plan entry, in plan order: the plan's index finds it in O(1).
  const PlanEntry* e = plan_->FindNext(key, cursor);
  if (e == nullptr) return nullptr;
  const size_t i = static_cast<size_t>(e - plan_->entries().data());
  return i < tensors_.size() && tensors_[i].entry == e ? &tensors_[i] : nullptr;
}

}  // namespace shardcast
