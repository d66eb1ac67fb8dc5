// python/binding: the _shardcast extension. Thin: it turns Python arguments into the C++ core's
// types, runs the load without the GIL, and maps every shardcast::Error kind to its own Python
// exception class (the package re-exports them).
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/utils/pybind.h>

#include <fcntl.h>
#include <sys/stat.h>

#include <nlohmann/json.hpp>

#include "loaders/checkpoint.h"
#include "loaders/posix_file.h"
#include "runtime/buffer_init.h"
#include "runtime/c10d_communicator.h"
#include "runtime/load.h"
#include "runtime/save.h"
#include "runtime/torch_dtype.h"
#include "allocators/units.h"

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

// The options a load or save runs with: SHARDCAST_* from the environment, then the keywords the caller
// gave ({name: text}); `source_flag` names the source keyword in messages ("source=" or save's "mode=").
LoadOptions OptionsFrom(py::dict opts, const std::string& source_flag = "source=") {
  LoadOptionsBuilder b;
  b.FromEnvironment();
  for (auto [k, v] : opts) {
    const std::string name = k.cast<std::string>();
    b.Set(OptionNamed(name), v.cast<std::string>(), name == "source" ? source_flag : name + "=");
  }
  return b.Build();
}

// entries: [(key, local tensor, global shape, role, layout index, compose or None)], one per entry, in an
// order every rank shares (the model's named_parameters/named_buffers order). options: {name: text},
// only those the caller gave (the environment fills the rest; given ones win). problem: (kind name,
// message) when the caller already failed on this rank: it is agreed in the handshake, so every rank
// raises it instead of waiting. store: this operation's own (a prefix of the group's store, _group.py): its
// ranks make a Gloo group of their own over it, which a failure aborts without touching the caller's.
py::dict LoadEntries(py::list entries, py::list layouts, const std::string& checkpoint, py::dict opts, py::dict tied,
                     py::object store_obj, int rank, int world_size, py::object progress,
                     py::object problem, const std::string& store_host) {
  c10::intrusive_ptr<c10d::Store> store;
  if (!store_obj.is_none()) store = store_obj.cast<c10::intrusive_ptr<c10d::Store>>();
  if (world_size > 1 && !store) {
    throw Error(ErrorKind::kInvalidArgument, "process group", "no store for a world of " + std::to_string(world_size));
  }
  std::optional<Error> failed;
  if (!problem.is_none()) {
    auto p = problem.cast<std::pair<std::string, std::string>>();
    failed = Error(ErrorKindFromName(p.first), "", p.second);
  }
  LoadRequest rq;
  rq.checkpoint = checkpoint;
  try {
    rq.options = OptionsFrom(opts);
  } catch (const Error& e) {
    if (!failed) failed = e;
  }
  rq.progress = PythonProgress(progress);
  ModelSpec spec;
  spec.source = "<python model>";
  spec.model_type = "python";
  spec.config_json = "{}";
  std::vector<at::Tensor> tensors;
  std::vector<std::pair<std::string, int64_t>> layout_index;
  for (py::handle h : entries) {
    auto t = h.cast<py::tuple>();
    SpecEntry e;
    e.key = t[0].cast<std::string>();
    at::Tensor x = t[1].cast<at::Tensor>();
    for (auto d : t[2].cast<std::vector<int64_t>>()) e.shape.push_back(static_cast<uint64_t>(d));
    auto dtype = FromScalarType(x.scalar_type());
    if (!dtype && !failed) failed = Error(ErrorKind::kUnsupported, e.key, "dtype has no safetensors equivalent");
    e.dtype = dtype.value_or(DType::kU8);
    std::string role = t[3].cast<std::string>();
    e.role = role == "persistent_buffer" ? Role::kPersistentBuffer : Role::kParameter;
    const int64_t layout = t[4].cast<int64_t>();
    e.replicated = layout == -1;
    layout_index.emplace_back(e.key, layout);
    if (!t[5].is_none()) rq.mapping.compose[e.key] = t[5].cast<std::vector<std::string>>();
    spec.entries.push_back(std::move(e));
    tensors.push_back(x);
  }
  rq.mapping.tied = tied.cast<std::map<std::string, std::string>>();
  PlanOptions plan_options;
  try {
    plan_options = LayoutsFrom(layouts, layout_index);
  } catch (const Error& e) {
    if (!failed) failed = e;
  }

  LoadReport report;
  {
    py::gil_scoped_release nogil;
    std::unique_ptr<Communicator> comm =
        world_size == 1 ? CreateLocalCommunicator()
                        : CreateGlooCommunicatorOnStore(store, rank, world_size, rq.options.timeout, store_host);
    std::optional<Plan> plan;
    std::optional<RankState> state;
    try {
      if (failed) throw *failed;
      plan.emplace(Plan::Build(std::move(spec), world_size, plan_options));
      state.emplace(RankState::Adopt(*plan, rank, std::move(tensors)));
    } catch (const Error& e) {
      FailLoad(*comm, e.kind(), e.what());
    }
    report = Load(*comm, &*state, rq);
  }
  return py::module_::import("json").attr("loads")(report.ToJson()).cast<py::dict>();
}

// The save: entries as for load_entries, but each with its output tensors [(key, shape)] in
// concatenation order (None: one tensor, its own key and shape). dtype: a safetensors dtype name or
// None; max_shard_size: text for the one size parser ("5GB"). A problem, or an argument that fails to
// parse, is agreed in the save's first verdict, so every rank raises it. file_numbers ({output key: 1..n},
// torch DCP's fqn_to_index_mapping), keep_other_files and numbered_files: SaveRequest's fields of those names.
py::dict SaveEntries(py::list entries, py::list layouts, const std::string& out_dir, py::dict opts, py::object dtype,
                     const std::string& max_shard_size, bool overwrite, const std::string& config_json,
                     const std::string& generation_config_json, py::object store_obj, int rank,
                     int world_size, py::object progress, py::object problem, const std::string& store_host,
                     py::dict file_numbers, bool keep_other_files, bool numbered_files) {
  c10::intrusive_ptr<c10d::Store> store;
  if (!store_obj.is_none()) store = store_obj.cast<c10::intrusive_ptr<c10d::Store>>();
  if (world_size > 1 && !store) {
    throw Error(ErrorKind::kInvalidArgument, "process group", "no store for a world of " + std::to_string(world_size));
  }
  std::optional<Error> failed;
  if (!problem.is_none()) {
    auto p = problem.cast<std::pair<std::string, std::string>>();
    failed = Error(ErrorKindFromName(p.first), "", p.second);
  }
  SaveRequest rq;
  rq.keep_other_files = keep_other_files;
  rq.numbered_files = numbered_files;
  for (auto [k, v] : file_numbers) {
    const int64_t n = v.cast<int64_t>();
    if ((n < 1 || n > UINT32_MAX) && !failed) {
      failed = Error(ErrorKind::kInvalidArgument, "key '" + k.cast<std::string>() + "'",
                     "file number " + std::to_string(n) + " (fqn_to_index_mapping's numbers start at 1)");
    }
    rq.file_numbers[k.cast<std::string>()] = static_cast<uint32_t>(std::max<int64_t>(n, 0));
  }
  rq.out_dir = out_dir;
  rq.overwrite = overwrite;
  rq.config_json = config_json;
  rq.generation_config_json = generation_config_json;
  try {
    rq.options = OptionsFrom(opts, "mode=");
    rq.max_shard_bytes = ParseBytes(max_shard_size, "max_shard_size=");
    if (rq.max_shard_bytes == 0) throw Error(ErrorKind::kInvalidArgument, "max_shard_size=", "must be more than 0 bytes");
    if (!dtype.is_none()) {
      const std::string name = dtype.cast<std::string>();
      auto d = ParseFloatDType(name);
      if (!d) {
        throw Error(ErrorKind::kInvalidArgument, "dtype=", "'" + name + "': a save converts to float16, bfloat16 or "
                                                               "float32 only (it never quantizes)");
      }
      rq.dtype = *d;
    }
  } catch (const Error& e) {
    if (!failed) failed = e;
  }
  rq.progress = PythonProgress(progress);
  ModelSpec spec;
  spec.source = "<python model>";
  spec.model_type = "python";
  spec.config_json = "{}";
  std::vector<at::Tensor> tensors;
  std::vector<std::pair<std::string, int64_t>> layout_index;
  for (py::handle h : entries) {
    auto t = h.cast<py::tuple>();
    SpecEntry e;
    e.key = t[0].cast<std::string>();
    at::Tensor x = t[1].cast<at::Tensor>();
    for (auto d : t[2].cast<std::vector<int64_t>>()) e.shape.push_back(static_cast<uint64_t>(d));
    auto dt = FromScalarType(x.scalar_type());
    if (!dt && !failed) failed = Error(ErrorKind::kUnsupported, e.key, "dtype has no safetensors equivalent");
    e.dtype = dt.value_or(DType::kU8);
    e.role = t[3].cast<std::string>() == "persistent_buffer" ? Role::kPersistentBuffer : Role::kParameter;
    const int64_t layout = t[4].cast<int64_t>();
    e.replicated = layout == -1;
    layout_index.emplace_back(e.key, layout);
    if (!t[5].is_none()) {
      auto& outs = rq.outputs[e.key];
      for (auto o : t[5].cast<py::list>()) {
        auto pair = o.cast<py::tuple>();
        SaveOutput out{pair[0].cast<std::string>(), {}};
        for (auto d : pair[1].cast<std::vector<int64_t>>()) out.shape.push_back(static_cast<uint64_t>(d));
        outs.push_back(std::move(out));
      }
    }
    spec.entries.push_back(std::move(e));
    tensors.push_back(x);
  }
  PlanOptions plan_options;
  try {
    plan_options = LayoutsFrom(layouts, layout_index);
  } catch (const Error& e) {
    if (!failed) failed = e;
  }

  SaveReport report;
  {
    py::gil_scoped_release nogil;
    std::unique_ptr<Communicator> comm =
        world_size == 1 ? CreateLocalCommunicator()
                        : CreateGlooCommunicatorOnStore(store, rank, world_size, rq.options.timeout, store_host);
    std::optional<Plan> plan;
    std::optional<RankState> state;
    try {
      if (failed) throw *failed;
      plan.emplace(Plan::Build(std::move(spec), world_size, plan_options));
      state.emplace(RankState::Adopt(*plan, rank, std::move(tensors)));
    } catch (const Error& e) {
      FailSave(*comm, e.kind(), e.what());
    }
    report = Save(*comm, &*state, rq);
  }
  return py::module_::import("json").attr("loads")(report.ToJson()).cast<py::dict>();
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
      [](py::dict opts) -> std::optional<double> {
        try {
          return std::chrono::duration<double>(OptionsFrom(opts).timeout).count();
        } catch (const Error&) {
          return std::nullopt;  // the load's own options builder raises it, on every rank
        }
      },
      py::arg("options"), "The per-collective timeout in seconds the load will use, or None if the options are bad.");
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
}
