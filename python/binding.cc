// python/binding: the _shardcast extension. Thin: it turns Python arguments into the C++ core's
// types, runs the load without the GIL, and maps every shardcast::Error kind to its own Python
// exception class (the package re-exports them).
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/utils/pybind.h>

#include <cerrno>
#include <cstring>
#include <fcntl.h>
#include <functional>
#include <sys/stat.h>

#include <nlohmann/json.hpp>

#include "allocators/tensor_alloc.h"
#include "allocators/units.h"
#include "loaders/checkpoint.h"
#include "loaders/posix_file.h"
#include "loaders/quant/format.h"
#include "runtime/agree/failure.h"
#include "runtime/agree/fault.h"
#include "runtime/comm/c10d_communicator.h"
#include "runtime/cpu_quota.h"
#include "runtime/load.h"
#include "runtime/materialize/buffer_init.h"
#include "runtime/materialize/torch_dtype.h"
#include "runtime/save.h"

namespace py = pybind11;

namespace shardcast {
namespace {

std::map<ErrorKind, py::object>& ExceptionTypes() {
  static auto* m = new std::map<ErrorKind, py::object>();
  return *m;
}

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

// layouts: [(mesh shape, ranks, [(kind, dim, split factor)])], kind 0 Replicate, 1 Shard, 2 _StridedShard
// (a DTensor's mesh and placements, ranks numbered in the process group). An entry's layout index
// refers into it; -1 is Replicate on every rank, -2 FSDP2's Shard(0) over the whole group.
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

// A Python value's type, for messages ("str", "torch.Tensor"); never throws.
std::string TypeName(py::handle h) {
  if (!h) return "nothing";
  const char* name = Py_TYPE(h.ptr())->tp_name;
  return name != nullptr ? name : "an object";
}

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

// This rank's first failure before the agreement, kept until the load's or save's first verdict
// (FailLoad/FailSave), which raises it on every rank. Every exception counts: a shardcast::Error keeps
// its kind; anything else (a pybind11::cast_error, a Python exception raised while converting a value,
// a std::exception from the core) is an InvalidArgument naming the argument. Nothing escapes here on
// one rank alone: its peers would wait out the rendezvous and raise a CommTimeout that names no cause.
// The verdict names the rank.
class Carried {
 public:
  // Runs `step`, even where this rank already failed (the options' timeout still shapes the
  // communicator); the first failure is the one carried. Whether `step` succeeded.
  template <typename F>
  bool Run(const std::string& argument, F&& step) {
    try {
      step();
      return true;
    } catch (const Error& e) {
      Take(e);
    } catch (const std::exception& e) {
      Take(Error(ErrorKind::kInvalidArgument, argument, e.what()));
    }
    return false;
  }
  void Take(const Error& e) {
    if (!error_) error_ = e;
  }
  const std::optional<Error>& error() const { return error_; }

 private:
  std::optional<Error> error_;
};

// The options a load or save runs with: SHARDCAST_* from the environment, then the keywords the caller
// gave ({name: text}).
LoadOptions OptionsFrom(py::handle opts) {
  LoadOptionsBuilder b;
  b.FromEnvironment();
  for (auto [k, v] : Cast<py::dict>(opts, "options", "a dict {name: text}")) {
    const std::string name = Cast<std::string>(k, "options", "option names as text");
    b.Set(OptionNamed(name), Cast<std::string>(v, name + "=", "text"), name + "=");
  }
  return b.Build();
}

// The timeout of options that may fail to build, for a rank that carries a problem into the agreement: the
// given or SHARDCAST_TIMEOUT_MS value where it parses (LoadOptionsBuilder::Timeout), else the default.
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

// A progress callback, checked now: one that is not callable would fail mid-stream instead.
Progress ProgressFrom(py::object progress) {
  if (!progress.is_none() && !PyCallable_Check(progress.ptr())) {
    throw Error(ErrorKind::kInvalidArgument, "progress=",
                "expected True, False, None or a callable(done_bytes, total_bytes), got " + TypeName(progress));
  }
  return PythonProgress(std::move(progress));
}

// The problem Python already found on this rank: (kind name, message), or (kind name, message, ranks) for
// an exchange that timed out waiting for those ranks (`absent`).
Error ProblemFrom(py::handle problem, std::vector<int>* absent) {
  auto t = Cast<py::tuple>(problem, "problem", "(kind name, message[, absent ranks])");
  if (t.size() == 3) *absent = Cast<std::vector<int>>(t[2], "problem", "absent ranks: a list of ints");
  auto p = Cast<std::pair<std::string, std::string>>(py::make_tuple(t[0], t[1]), "problem", "(kind name, message)");
  return Error(ErrorKindFromName(p.first), "", p.second);
}

// The store of the operation: without one, no communicator, so nothing can be agreed. Raised on this
// rank alone; it is the package's own argument, never the caller's.
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

// entries: [(key, local tensor, global shape, role, layout index, extra)], one per entry, in an order every
// rank shares. `extra(key, t[5])` takes the last field (load: compose or None; save: outputs or None).
struct Entries {
  ModelSpec spec;
  std::vector<at::Tensor> tensors;
  std::vector<std::pair<std::string, int64_t>> layout_index;
};

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
    if (t.size() != 6) throw Error(ErrorKind::kInvalidArgument, where, "expected 6 fields, got " + std::to_string(t.size()));
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

// What a load and a save share: this rank's store and what it already carries (the caller's problem, then
// any argument that fails to convert), its entries and their layouts.
struct Operation {
  c10::intrusive_ptr<c10d::Store> store;
  Carried carried;
  std::vector<int> absent;  // ranks an exchange before this call timed out waiting for (ProblemFrom)
  Entries in;
  PlanOptions plan_options;

  Operation(py::handle store_obj, int rank, int world_size, py::object problem)
      : store(StoreFrom(store_obj, rank, world_size)) {
    if (!problem.is_none()) carried.Run("problem", [&] { carried.Take(ProblemFrom(problem, &absent)); });
  }

  // The entries (each one's extra field to `extra`) and then their layouts, which name them.
  void ParseEntries(py::handle entries, py::handle layouts,
                    const std::function<void(const std::string& key, py::handle extra)>& extra) {
    carried.Run("entries", [&] { in = EntriesFrom(entries, carried, extra); });
    carried.Run("layouts", [&] {
      plan_options = LayoutsFrom(Cast<py::list>(layouts, "layouts", "a list"), in.layout_index);
    });
  }

  // Without the GIL: this operation's Communicator (the Gloo group kept from the last operation over the
  // same store where every rank agrees; a new group's ready barrier fails as `phase`, "load" or "save"), the
  // agreement's first phase, entered by every rank with its plan and shards or, where it already failed (or
  // fails building them), with its problem through `fail` (FailLoad or FailSave, which throw the agreed
  // error); then `run(comm, state)`, whose report comes back as a dict. The group is kept only after a success.
  template <typename Fail, typename Body>
  py::dict Run(int rank, int world_size, std::chrono::milliseconds timeout, const std::string& store_host,
               const char* phase, Fail&& fail, Body&& run) {
    std::string report;
    {
      py::gil_scoped_release nogil;
      std::unique_ptr<Communicator> comm =
          world_size == 1 ? CreateLocalCommunicator()
                          : CreateGlooCommunicatorOnStore(store, rank, world_size, timeout, store_host, absent, phase);
      std::optional<Plan> plan;
      std::optional<RankState> state;
      try {
        if (carried.error()) throw *carried.error();
        plan.emplace(Plan::Build(std::move(in.spec), world_size, plan_options));
        state.emplace(RankState::Adopt(*plan, rank, std::move(in.tensors)));
      } catch (const std::exception& e) {
        const Problem p = AsProblem(e);
        fail(*comm, p.kind, p.message);
      }
      report = run(*comm, &*state).ToJson();
      KeepGlooGroup(std::move(comm));
    }
    return py::module_::import("json").attr("loads")(report).cast<py::dict>();
  }
};

// (__metadata__, [(key, dtype name, shape, begin, end)]) of a validated file, for Python.
py::tuple HeaderTuple(const SafetensorsFile& f) {
  py::dict metadata;
  for (const auto& [k, v] : f.header().metadata) metadata[py::str(k)] = py::str(v);
  py::list tensors;
  for (const TensorInfo& t : f.header().tensors) {
    tensors.append(py::make_tuple(t.key, std::string(DTypeName(t.dtype)), t.shape, t.begin, t.end));
  }
  return py::make_tuple(metadata, tensors);
}

// entries: [(key, local tensor, global shape, role, layout index, compose or None)], one per entry, in an
// order every rank shares (the model's named_parameters/named_buffers order). options: {name: text},
// only those the caller gave (the environment fills the rest; given ones win). problem: (kind name,
// message) when the caller already failed on this rank. It, and any argument here that fails to convert
// (a Carried), is agreed in the handshake, so every rank raises it instead of waiting. store: this
// operation's own (a prefix of the group's store, _group.py): its ranks make a Gloo group of their own
// over it, which a failure aborts without touching the caller's.
py::dict LoadEntries(py::object entries, py::object layouts, py::object checkpoint, py::object opts, py::object tied,
                     py::object store_obj, int rank, int world_size, py::object progress,
                     py::object problem, const std::string& store_host) {
  Operation op(store_obj, rank, world_size, problem);
  Carried& carried = op.carried;
  LoadRequest rq;
  carried.Run("checkpoint", [&] { rq.checkpoint = Cast<std::string>(checkpoint, "path", "a path (text)"); });
  if (!carried.Run("options", [&] { rq.options = OptionsFrom(opts); })) rq.options.timeout = TimeoutFrom(opts);
  carried.Run("progress=", [&] { rq.progress = ProgressFrom(progress); });
  carried.Run("tied", [&] {
    rq.mapping.tied = Cast<std::map<std::string, std::string>>(tied, "tied", "a dict {key: key}");
  });
  op.ParseEntries(entries, layouts, [&](const std::string& key, py::handle compose) {
    rq.mapping.compose[key] = Cast<std::vector<std::string>>(compose, "key '" + key + "'", "a list of keys");
  });
  return op.Run(rank, world_size, rq.options.timeout, store_host, "load", FailLoad,
                [&](Communicator& comm, RankState* state) { return Load(comm, state, rq); });
}

// The save: entries as for load_entries, but each with its output tensors [(key, shape)] in
// concatenation order (None: one tensor, its own key and shape). dtype: a safetensors dtype name or
// None; max_shard_size: text for the one size parser ("5GB"). A problem, or an argument that fails to
// convert or parse, is agreed in the save's first verdict, so every rank raises it. file_numbers ({output
// key: 1..n}, torch DCP's fqn_to_index_mapping), keep_other_files and numbered_files: SaveRequest's
// fields of those names.
py::dict SaveEntries(py::object entries, py::object layouts, py::object out_dir, py::object opts, py::object dtype,
                     py::object max_shard_size, py::object overwrite, py::object config_json,
                     py::object generation_config_json, py::object store_obj, int rank, int world_size,
                     py::object progress, py::object problem, const std::string& store_host, py::object file_numbers,
                     py::object keep_other_files, py::object numbered_files) {
  Operation op(store_obj, rank, world_size, problem);
  Carried& carried = op.carried;
  SaveRequest rq;
  carried.Run("arguments", [&] {
    rq.out_dir = Cast<std::string>(out_dir, "out_dir", "a path (text)");
    rq.overwrite = Cast<bool>(overwrite, "overwrite=", "a bool");
    rq.keep_other_files = Cast<bool>(keep_other_files, "keep_other_files", "a bool");
    rq.numbered_files = Cast<bool>(numbered_files, "numbered_files", "a bool");
    rq.config_json = Cast<std::string>(config_json, "config", "config.json's text");
    rq.generation_config_json = Cast<std::string>(generation_config_json, "config", "generation_config.json's text");
  });
  carried.Run("file_numbers", [&] {
    for (auto [k, v] : Cast<py::dict>(file_numbers, "file_numbers", "a dict {key: file number}")) {
      const std::string key = Cast<std::string>(k, "file_numbers", "keys as text");
      const int64_t n = Cast<int64_t>(v, "key '" + key + "'", "a file number (int)");
      if (n < 1 || n > UINT32_MAX) {
        throw Error(ErrorKind::kInvalidArgument, "key '" + key + "'",
                    "file number " + std::to_string(n) + " (fqn_to_index_mapping's numbers start at 1)");
      }
      rq.file_numbers[key] = static_cast<uint32_t>(n);
    }
  });
  if (!carried.Run("options", [&] { rq.options = OptionsFrom(opts); })) rq.options.timeout = TimeoutFrom(opts);
  carried.Run("max_shard_size=", [&] {
    rq.max_shard_bytes = ParseBytes(Cast<std::string>(max_shard_size, "max_shard_size=", "a size (\"5GB\" or bytes)"),
                                    "max_shard_size=");
    if (rq.max_shard_bytes == 0) throw Error(ErrorKind::kInvalidArgument, "max_shard_size=", "must be more than 0 bytes");
  });
  carried.Run("dtype=", [&] {
    if (dtype.is_none()) return;
    const std::string name = Cast<std::string>(dtype, "dtype=", "a dtype name");
    auto d = ParseFloatDType(name);
    if (!d) {
      throw Error(ErrorKind::kInvalidArgument, "dtype=", "'" + name + "': a save converts to float16, bfloat16 or "
                                                             "float32 only (it never quantizes)");
    }
    rq.dtype = *d;
  });
  carried.Run("progress=", [&] { rq.progress = ProgressFrom(progress); });
  op.ParseEntries(entries, layouts, [&](const std::string& key, py::handle outputs) {
    const std::string where = "key '" + key + "'";
    auto& outs = rq.outputs[key];
    for (auto o : Cast<py::list>(outputs, where, "a list of (output key, shape)")) {
      auto pair = Cast<std::pair<std::string, std::vector<int64_t>>>(o, where, "(output key, shape)");
      SaveOutput out{pair.first, {}};
      for (auto d : pair.second) out.shape.push_back(static_cast<uint64_t>(d));
      outs.push_back(std::move(out));
    }
  });
  return op.Run(rank, world_size, rq.options.timeout, store_host, "save", FailSave,
                [&](Communicator& comm, RankState* state) { return Save(comm, state, rq); });
}

}  // namespace
}  // namespace shardcast

PYBIND11_MODULE(_shardcast, m) {
  using namespace shardcast;
  m.doc() = "shardcast's C++ core: locally computed buffers and the sharded streaming load";
  py::object base = py::reinterpret_borrow<py::object>(PyExc_RuntimeError);
  py::object root = py::reinterpret_steal<py::object>(
      PyErr_NewExceptionWithDoc("shardcast.ShardcastError", "Base of every shardcast error.", base.ptr(), nullptr));
  m.attr("ShardcastError") = root;
  const std::pair<ErrorKind, const char*> kinds[] = {
      {ErrorKind::kInvalidArgument, "InvalidArgument"}, {ErrorKind::kConfig, "ConfigError"},
      {ErrorKind::kCheckpoint, "CheckpointError"},      {ErrorKind::kIo, "IoError"},
      {ErrorKind::kManifestMismatch, "ManifestMismatch"}, {ErrorKind::kCommTimeout, "CommTimeout"},
      {ErrorKind::kComm, "CommError"},                  {ErrorKind::kUnsupported, "Unsupported"},
      {ErrorKind::kInternal, "InternalError"}};
  for (const auto& [kind, name] : kinds) {
    std::string qualified = std::string("shardcast.") + name;
    py::object cls = py::reinterpret_steal<py::object>(PyErr_NewException(qualified.c_str(), root.ptr(), nullptr));
    m.attr(name) = cls;
    ExceptionTypes()[kind] = cls;
  }
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const Error& e) {
      PyErr_SetString(ExceptionTypes().at(e.kind()).ptr(), e.what());
    }
  });

  m.def(
      "prefetch_file_range",
      [](const std::string& path, uint64_t offset, uint64_t length) {
        UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
        struct stat st;
        if (fd.get() < 0 || fstat(fd.get(), &st) != 0) return false;
        AdviseWillNeed(fd.get(), st.st_dev, offset, length);
        return true;
      },
      py::arg("path"), py::arg("offset"), py::arg("length"), py::call_guard<py::gil_scoped_release>(),
      "Asks the kernel to read the file's bytes [offset, offset + length) into the page cache, in steps "
      "its read-ahead limit allows; False where the file cannot be opened.");
  m.def("fault_point", [](const std::string& point, int rank) { FaultPoint(point.c_str(), rank); }, py::arg("point"),
        py::arg("rank"), py::call_guard<py::gil_scoped_release>(),
        "A named point where a test makes this process fail on purpose (runtime/agree/fault.h: SHARDCAST_FAULT, "
        "acting only with SHARDCAST_TEST_FAULTS=1); nothing otherwise.");
  m.def(
      "lazy_zero_tensor",
      [](const std::vector<int64_t>& shape, at::ScalarType dtype) {
        for (int64_t n : shape) {
          if (n < 0) throw Error(ErrorKind::kInvalidArgument, "lazy_zero_tensor", "negative size in the shape");
        }
        return LazyZeroTensor(shape, dtype);
      },
      py::arg("shape"), py::arg("dtype"),
      "A contiguous CPU tensor on a fresh anonymous mapping (allocators/lazy_zero.h): it reads as zeros and "
      "commits no memory until written, page by page; its storage is unmapped when freed, never recycled. "
      "IoError naming the size where the mapping is refused.");
  m.def(
      "launch_environment",
      [] {
        const Rendezvous rv = RendezvousFromEnvironment();
        return py::make_tuple(rv.source, rv.rank, rv.world_size, rv.local_rank, rv.local_world_size);
      },
      "(launcher, rank, world size, local rank, local world size) from torchrun's or SLURM's variables, by the "
      "rendezvous' own parser (runtime/launch_env.cc): launcher is \"torchrun\", \"slurm\" or \"default\". "
      "InvalidArgument naming the variable for a value it cannot read.");
  m.def(
      "cpu_quota",
      [](const std::string& root, const std::string& proc) {
        const CpuQuota q = CpuQuotaOf(root, proc);
        auto name = py::reinterpret_steal<py::str>(PyUnicode_DecodeFSDefaultAndSize(q.cgroup.data(), q.cgroup.size()));
        if (!name) throw py::error_already_set();  // a path's bytes are decoded as os.fsdecode does: never here
        return py::make_tuple(name, q.cpus);
      },
      py::arg("root"), py::arg("proc"),
      "(this process's CPU cgroup, the CPUs its quota allows or None) by the loader's own reader "
      "(runtime/cpu_quota.h), for the cgroup mount `root` and the /proc/<pid>/cgroup file `proc`.");
  m.def("has_buffer_rule", [](const std::string& key) { return BufferInitRegistry::Global().Find(key, "") != nullptr; },
        "Whether a built-in init rule matches this buffer key.");
  m.def(
      "init_buffer",
      [](const std::string& config_json, const std::string& source, const std::string& key, at::Tensor out) {
        nlohmann::json config = nlohmann::json::parse(config_json);
        at::Tensor host = out.device().is_cpu() ? out : at::empty_like(out, at::TensorOptions().device(at::kCPU));
        std::string note = BufferInitRegistry::Global().Run(BufferInitContext{config, source, key}, "", host);
        if (!out.device().is_cpu()) out.copy_(host);
        return note;
      },
      py::arg("config_json"), py::arg("source"), py::arg("key"), py::arg("out"),
      "Fills `out` (zeroed, the buffer's shape and dtype) with the buffer's locally computed values.");
  m.def(
      "open_checkpoint_name",
      [](const std::string& dir, const std::string& name) -> std::optional<int> {
        std::optional<OpenNode> node = OpenCheckpointName(dir, name);
        if (!node) return std::nullopt;
        return node->fd.release();
      },
      py::arg("dir"), py::arg("name"),
      "A descriptor (the caller closes it) for `name` of the checkpoint directory `dir`, resolved beneath its "
      "root as the loader resolves it; None when there is no such name. CheckpointError when it resolves "
      "outside the root or loops.");
  m.def(
      "safetensors_header",
      [](const std::string& dir, const std::string& name) {
        std::unique_ptr<SafetensorsFile> f;
        {
          py::gil_scoped_release nogil;
          std::optional<OpenNode> node = OpenCheckpointName(dir, name);
          if (!node) throw Error(ErrorKind::kIo, dir + "/" + name, "no such file");
          f = SafetensorsFile::FromDescriptor(node->fd.release(), dir + "/" + name);
        }
        return HeaderTuple(*f);
      },
      py::arg("dir"), py::arg("name"),
      "(__metadata__ as a dict, [(key, safetensors dtype name, shape, begin, end)] in header order; begin and end "
      "relative to the data area, which starts at 8 + the header's length) of the file `name` of the directory "
      "`dir`, resolved beneath it as the loader resolves names and validated by the loader's reader. "
      "CheckpointError naming the file otherwise; IoError when there is no such file.");
  m.def(
      "safetensors_header_of",
      [](int fd, const std::string& where) {
        std::unique_ptr<SafetensorsFile> f;
        {
          py::gil_scoped_release nogil;
          const int own = fcntl(fd, F_DUPFD_CLOEXEC, 0);  // the caller keeps its descriptor; the reader closes its own
          if (own < 0) throw Error(ErrorKind::kIo, where, std::string("cannot duplicate its descriptor: ") + strerror(errno));
          OpenOptions o;
          o.mode = ReadMode::kPread;  // the header only: nothing mapped
          o.sequential_hint = false;
          f = SafetensorsFile::FromDescriptor(own, where, o);
        }
        return HeaderTuple(*f);
      },
      py::arg("fd"), py::arg("where"),
      "safetensors_header's answer for a file the caller opened (its descriptor, not closed here; `where` names "
      "it in errors), validated by the same reader.");
  m.def(
      "checkpoint_tensors",
      [](const std::string& path) {
        std::unique_ptr<Checkpoint> ck;
        {
          py::gil_scoped_release nogil;
          ck = Checkpoint::Open(path);
        }
        py::list out;
        for (const std::string& key : ck->keys()) {
          const Checkpoint::Entry& e = ck->Get(key);
          out.append(py::make_tuple(key, std::string(DTypeName(e.info->dtype)), e.info->shape, e.file->path()));
        }
        return out;
      },
      py::arg("path"),
      "[(key, safetensors dtype name, shape, file path)] of every tensor of a checkpoint (a file, or a directory "
      "with model.safetensors.index.json or model.safetensors), sorted by key: opened and validated by the "
      "loader's own reader (headers, index, names beneath the root). CheckpointError naming the file otherwise.");
  m.def(
      "quantization_of",
      [](py::list tensors) {
        // The tensors as detect sees them: {key: (dtype, shape)}; a dtype is a safetensors name or a torch.dtype.
        std::unordered_map<std::string, std::pair<DType, std::vector<uint64_t>>> stored;
        std::vector<std::string> keys;
        for (py::handle h : tensors) {
          const auto t = Cast<py::tuple>(h, "tensors", "(key, dtype, shape) tuples");
          if (t.size() != 3) throw Error(ErrorKind::kInvalidArgument, "tensors", "expected (key, dtype, shape) tuples");
          const std::string key = Cast<std::string>(t[0], "tensors", "a key (text)");
          const std::string where = "tensor '" + key + "'";
          std::optional<DType> dtype = py::isinstance<py::str>(t[1])
                                           ? ParseDType(t[1].cast<std::string>())
                                           : FromScalarType(Cast<at::ScalarType>(t[1], where, "a dtype name or torch.dtype"));
          if (dtype) stored[key] = {*dtype, Cast<std::vector<uint64_t>>(t[2], where, "a shape (list of sizes)")};  // else no format's
          keys.push_back(key);
        }
        const FindStored find = [&stored](const std::string& key) -> std::optional<StoredTensor> {
          auto it = stored.find(key);
          if (it == stored.end()) return std::nullopt;
          return StoredTensor{it->second.first, &it->second.second};
        };
        static constexpr const char* kPieces[] = {"", "data", "scale", "sidecar"};
        py::list out;
        for (const std::string& key : keys) {
          const QuantMatch q = DetectQuant(find, key);
          if (q.piece == QuantPiece::kNone) {
            out.append(py::none());
            continue;
          }
          const std::vector<uint64_t>& shape = stored.at(key).second;  // detect found it
          py::dict d;
          d["format"] = std::string(q.format->name);
          d["piece"] = kPieces[static_cast<int>(q.piece)];
          d["partner"] = q.partner;
          d["model_key"] = q.model_key;
          d["model_shape"] = q.format->model_shape(shape);
          d["kept_shape"] = q.format->kept_shape(shape);
          d["complete"] = q.complete;
          out.append(d);
        }
        return out;
      },
      py::arg("tensors"),
      "For [(key, dtype, shape)] (a safetensors dtype name or a torch.dtype; one safetensors lacks is no "
      "format's), each key's quantized format as the C++ registry decides it (loaders/quant/format.h), in "
      "order: None, or {format, piece ('data', 'scale' or 'sidecar'), partner, model_key, model_shape ([] "
      "when the stored shape makes none), kept_shape, complete}. Python keeps no copy of the formats' rules.");
  m.def(
      "layout_piece",
      [](std::vector<uint64_t> shape, py::list layouts, int rank) {
        PlanOptions o = LayoutsFrom(layouts, {});
        const Layout& l = o.layouts.at(0);
        l.Check(shape, "layout_piece");
        const Piece p = PieceOf(shape, l, rank);
        py::list dims;
        for (const auto& spans : p.dims) {
          py::list d;
          for (const Span& s : spans) d.append(py::make_tuple(s.begin, s.end));
          dims.append(d);
        }
        return py::make_tuple(p.held, dims);
      },
      py::arg("shape"), py::arg("layouts"), py::arg("rank"),
      "(held, [[(begin, end)] per dim]): the global spans `rank` holds of a tensor under layouts[0], as the "
      "load and save stream them.");
  m.def(
      "load_timeout_seconds",
      [](py::dict opts) { return std::chrono::duration<double>(TimeoutFrom(opts)).count(); },
      py::arg("options"),
      "The per-collective timeout in seconds the load will use: the options' own, also where the other options "
      "are bad (a rank that failed waits for the others as long as they wait for it).");
  m.def(
      "load_target", [](py::dict opts) { return std::string(TargetName(OptionsFrom(opts).target)); },
      py::arg("options"),
      "The target the load will use (\"cpu\", \"pinned\", \"cuda\"): the options' own, else SHARDCAST_TARGET's, "
      "by the one options parser; InvalidArgument naming the option or variable for a value it cannot read.");
  m.def("load_entries", &LoadEntries, py::arg("entries"), py::arg("layouts"), py::arg("checkpoint"), py::arg("options"),
        py::arg("tied"), py::arg("store"), py::arg("rank"), py::arg("world_size"),
        py::arg("progress") = py::none(), py::arg("problem") = py::none(),
        py::arg("store_host") = "the process group's store");
  m.def("save_entries", &SaveEntries, py::arg("entries"), py::arg("layouts"), py::arg("out_dir"), py::arg("options"), py::arg("dtype"),
        py::arg("max_shard_size"), py::arg("overwrite"), py::arg("config_json"), py::arg("generation_config_json"),
        py::arg("store"), py::arg("rank"), py::arg("world_size"), py::arg("progress") = py::none(),
        py::arg("problem") = py::none(),
        py::arg("store_host") = "the process group's store", py::arg("file_numbers") = py::dict(),
        py::arg("keep_other_files") = false, py::arg("numbered_files") = false);
  m.def(
      "forget_gloo_groups", [] { ForgetGlooGroups(); },
      "Drops the Gloo groups kept between operations (torch.distributed was shut down: the groups they served "
      "are gone).");
}
