// python/arguments: the conversions arguments.h declares.
#include "python/arguments.h"

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>
#include <memory>
#include <tuple>

#include "runtime/materialize/torch_dtype.h"

namespace shardcast::binding {
namespace {

Option OptionNamed(const std::string& name) {  // by OptionTable()'s keywords
  for (const OptionInfo& info : OptionTable()) {
    if (*info.keyword != '\0' && name == info.keyword) return info.option;
  }
  throw Error(ErrorKind::kInternal, "load options", "no option named " + name);
}

// Called on this rank as its messages complete, at most every 100 ms (and at the end), with the GIL.
Progress PythonProgress(py::object callback) {
  if (callback.is_none()) return {};
  auto last = std::make_shared<std::chrono::steady_clock::time_point>();
  auto cb = std::make_shared<py::object>(std::move(callback));
  return [cb, last](uint64_t done, uint64_t total) {
    const auto now = std::chrono::steady_clock::now();
    if (done < total && now - *last < std::chrono::milliseconds(100)) return;
    *last = now;
    py::gil_scoped_acquire gil;
    (*cb)(done, total);
  };
}

}  // namespace

std::string TypeName(py::handle h) {
  if (!h) return "nothing";
  const char* name = Py_TYPE(h.ptr())->tp_name;
  return name != nullptr ? name : "an object";
}

LoadOptions OptionsFrom(py::handle opts) {
  LoadOptionsBuilder b;
  b.FromEnvironment();
  for (auto [k, v] : Cast<py::dict>(opts, "options", "a dict {name: text}")) {
    const std::string name = Cast<std::string>(k, "options", "option names as text");
    b.Set(OptionNamed(name), Cast<std::string>(v, name + "=", "text"), name + "=");
  }
  return b.Build();
}

std::chrono::milliseconds TimeoutFrom(py::handle opts) {
  LoadOptionsBuilder b;
  b.FromEnvironment();
  if (py::isinstance<py::dict>(opts)) {
    for (auto [k, v] : py::reinterpret_borrow<py::dict>(opts)) {
      if (!py::isinstance<py::str>(k) || !py::isinstance<py::str>(v)) continue;
      try {
        const std::string name = k.cast<std::string>();
        if (OptionNamed(name) == Option::kTimeoutMs) b.Set(Option::kTimeoutMs, v.cast<std::string>(), name + "=");
      } catch (const std::exception&) {  // another option's name, or none: not the timeout
      }
    }
  }
  return b.Timeout();
}

Progress ProgressFrom(py::object progress) {
  if (!progress.is_none() && !PyCallable_Check(progress.ptr())) {
    throw Error(ErrorKind::kInvalidArgument, "progress=",
                "expected True, False, None or a callable(done_bytes, total_bytes), got " + TypeName(progress));
  }
  return PythonProgress(std::move(progress));
}

PlanOptions LayoutsFrom(py::list layouts, const std::vector<std::pair<std::string, int64_t>>& index) {
  PlanOptions o;
  for (py::handle h : layouts) {
    auto t = h.cast<py::tuple>();
    Layout l;
    for (auto d : t[0].cast<std::vector<int64_t>>()) l.mesh_shape.push_back(static_cast<uint32_t>(d));
    for (auto r : t[1].cast<std::vector<int64_t>>()) l.ranks.push_back(static_cast<int>(r));
    for (py::handle ph : t[2].cast<py::list>()) {
      auto pt = ph.cast<std::tuple<int, int, int64_t>>();
      const int kind = std::get<0>(pt);
      if (kind < 0 || kind > 2) throw Error(ErrorKind::kInternal, "layout", "placement kind " + std::to_string(kind));
      l.placements.push_back(Placement{static_cast<Placement::Kind>(kind), std::get<1>(pt),
                                       static_cast<uint32_t>(std::get<2>(pt))});
    }
    if (t.size() > 3) {  // explicit boxes: [(offset, size)], one per rank in t[1]
      for (py::handle bh : t[3].cast<py::list>()) {
        auto bt = bh.cast<std::pair<std::vector<uint64_t>, std::vector<uint64_t>>>();
        l.boxes.push_back(Box{bt.first, bt.second});
      }
    }
    o.layouts.push_back(std::move(l));
  }
  for (const auto& [key, i] : index) {
    if (i >= 0) o.layout_of[key] = static_cast<uint32_t>(i);
  }
  return o;
}

Error ProblemFrom(py::handle problem, std::vector<int>* absent) {
  auto t = Cast<py::tuple>(problem, "problem", "(kind name, message[, absent ranks])");
  if (t.size() == 3) *absent = Cast<std::vector<int>>(t[2], "problem", "absent ranks: a list of ints");
  auto p = Cast<std::pair<std::string, std::string>>(py::make_tuple(t[0], t[1]), "problem", "(kind name, message)");
  return Error(ErrorKindFromName(p.first), "", p.second);
}

c10::intrusive_ptr<c10d::Store> StoreFrom(py::handle store_obj, int rank, int world_size) {
  c10::intrusive_ptr<c10d::Store> store;
  if (!store_obj.is_none()) {
    try {
      store = store_obj.cast<c10::intrusive_ptr<c10d::Store>>();
    } catch (const std::exception&) {
      throw Error(ErrorKind::kInvalidArgument, "store", "rank " + std::to_string(rank) +
                                                            ": expected a torch.distributed.Store, got " +
                                                            TypeName(store_obj));
    }
  }
  if (world_size > 1 && !store) {
    throw Error(ErrorKind::kInvalidArgument, "process group", "no store for a world of " + std::to_string(world_size));
  }
  return store;
}

Entries EntriesFrom(py::handle entries, Carried& carried,
                    const std::function<void(const std::string& key, py::handle extra)>& extra) {
  Entries out;
  out.spec.source = "<python model>";
  out.spec.model_type = "python";
  out.spec.config_json = "{}";
  size_t i = 0;
  for (py::handle h : Cast<py::list>(entries, "entries", "a list")) {
    const std::string where = "entry " + std::to_string(i++);
    auto t = Cast<py::tuple>(h, where, "a tuple (key, tensor, shape, role, layout, extra)");
    if (t.size() != 6) {
      throw Error(ErrorKind::kInvalidArgument, where, "expected 6 fields, got " + std::to_string(t.size()));
    }
    SpecEntry e;
    e.key = Cast<std::string>(t[0], where, "a key (text)");
    const std::string key = "key '" + e.key + "'";
    at::Tensor x = Cast<at::Tensor>(t[1], key, "a torch.Tensor");
    for (auto d : Cast<std::vector<int64_t>>(t[2], key, "a shape (ints)")) e.shape.push_back(static_cast<uint64_t>(d));
    auto dtype = FromScalarType(x.scalar_type());
    if (!dtype) {
      carried.Take(Error(ErrorKind::kUnsupported, key,
                         std::string("dtype ") + c10::toString(x.scalar_type()) + " has no safetensors equivalent"));
    }
    e.dtype = dtype.value_or(DType::kU8);
    e.role = Cast<std::string>(t[3], key, "a role (text)") == "persistent_buffer" ? Role::kPersistentBuffer
                                                                                   : Role::kParameter;
    const int64_t layout = Cast<int64_t>(t[4], key, "a layout index (int)");
    e.replicated = layout == -1;
    out.layout_index.emplace_back(e.key, layout);
    if (!t[5].is_none()) extra(e.key, t[5]);
    out.spec.entries.push_back(std::move(e));
    out.tensors.push_back(x);
  }
  return out;
}

}  // namespace shardcast::binding
