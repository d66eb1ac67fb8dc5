// python/arguments: Python values into the core's types, for every part of the binding: any one value
// (Cast), the options, a progress callback, the layouts, and a load's or save's problem, store and entries.
// A value that does not convert is a shardcast::Error naming the argument, never pybind11's cast_error.
// Called with the GIL.
#pragma once

#include <c10/util/intrusive_ptr.h>
#include <torch/csrc/utils/pybind.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "allocators/error.h"
#include "loaders/model_spec.h"
#include "python/carried.h"
#include "runtime/layout/plan.h"
#include "runtime/load_options.h"
#include "runtime/stream/progress.h"

namespace c10d {
class Store;  // torch/csrc/distributed/c10d/Store.hpp: heavy, and only StoreFrom's callers need it whole
}  // namespace c10d

namespace py = pybind11;

namespace shardcast::binding {

// A Python value's type, for messages ("str", "torch.Tensor"); never throws.
std::string TypeName(py::handle h);

// h as T, or kInvalidArgument naming `argument`, what it expected and the type it got. pybind11's own
// cast_error names neither (and a Python exception raised while converting is no better).
template <typename T>
T Cast(py::handle h, const std::string& argument, const char* expected) {
  try {
    return h.cast<T>();
  } catch (const std::exception&) {
    throw Error(ErrorKind::kInvalidArgument, argument, std::string("expected ") + expected + ", got " + TypeName(h));
  }
}

// The options a load or save runs with: SHARDCAST_* from the environment, then the keywords the caller
// gave ({name: text}).
LoadOptions OptionsFrom(py::handle opts);

// The timeout of options that may fail to build, for a rank that carries a problem into the agreement: the
// given or SHARDCAST_TIMEOUT_MS value where it parses (LoadOptionsBuilder::Timeout), else the default.
std::chrono::milliseconds TimeoutFrom(py::handle opts);

// A progress callback, checked now: one that is not callable would fail mid-stream instead. It is called on
// this rank as its messages complete, at most every 100 ms (and at the end), with the GIL.
Progress ProgressFrom(py::object progress);

// layouts: [(mesh shape, ranks, [(kind, dim, split factor)])], kind 0 Replicate, 1 Shard, 2 _StridedShard
// (a DTensor's mesh and placements, ranks numbered in the process group). An entry's layout index
// refers into it; -1 is Replicate on every rank, -2 FSDP2's Shard(0) over the whole group.
PlanOptions LayoutsFrom(py::list layouts, const std::vector<std::pair<std::string, int64_t>>& index);

// The problem Python already found on this rank: (kind name, message), or (kind name, message, ranks) for
// an exchange that timed out waiting for those ranks (`absent`).
Error ProblemFrom(py::handle problem, std::vector<int>* absent);

// The store of the operation: without one, no communicator, so nothing can be agreed. Raised on this
// rank alone; it is the package's own argument, never the caller's.
c10::intrusive_ptr<c10d::Store> StoreFrom(py::handle store_obj, int rank, int world_size);

// entries: [(key, local tensor, global shape, role, layout index, extra)], one per entry, in an order every
// rank shares. `extra(key, t[5])` takes the last field (load: compose or None; save: outputs or None).
struct Entries {
  ModelSpec spec;
  std::vector<at::Tensor> tensors;
  std::vector<std::pair<std::string, int64_t>> layout_index;
};

// The entries, each one's extra field to `extra`; a dtype safetensors lacks is carried.
Entries EntriesFrom(py::handle entries, Carried& carried,
                    const std::function<void(const std::string& key, py::handle extra)>& extra);

}  // namespace shardcast::binding
