// python/load_save: the sharded load and save (load_entries, save_entries): each turns its arguments into
// a request, carrying any that fails into the agreement (operation.h), and runs without the GIL. Also what
// the load's options resolve to, and forgetting the Gloo groups kept between operations.
#include <torch/csrc/utils/pybind.h>

#include <chrono>
#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "allocators/units.h"
#include "loaders/dtype.h"
#include "python/arguments.h"
#include "python/binding_internal.h"
#include "python/operation.h"
#include "runtime/comm/c10d_communicator.h"
#include "runtime/layout/target.h"
#include "runtime/load.h"
#include "runtime/save.h"

namespace py = pybind11;

namespace shardcast::binding {
namespace {

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
                    "file number " + std::to_string(n) + " is outside 1.." + std::to_string(UINT32_MAX) +
                        " (fqn_to_index_mapping's numbers start at 1)");
      }
      rq.file_numbers[key] = static_cast<uint32_t>(n);
    }
  });
  if (!carried.Run("options", [&] { rq.options = OptionsFrom(opts); })) rq.options.timeout = TimeoutFrom(opts);
  carried.Run("max_shard_size=", [&] {
    rq.max_shard_bytes = ParseBytes(
        Cast<std::string>(max_shard_size, "max_shard_size=", "a size (\"5GB\" or bytes)"), "max_shard_size=");
    if (rq.max_shard_bytes == 0) {
      throw Error(ErrorKind::kInvalidArgument, "max_shard_size=", "must be more than 0 bytes");
    }
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

void BindLoadSave(py::module_& m) {
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
  m.def("save_entries", &SaveEntries, py::arg("entries"), py::arg("layouts"), py::arg("out_dir"), py::arg("options"),
        py::arg("dtype"), py::arg("max_shard_size"), py::arg("overwrite"), py::arg("config_json"),
        py::arg("generation_config_json"), py::arg("store"), py::arg("rank"), py::arg("world_size"),
        py::arg("progress") = py::none(), py::arg("problem") = py::none(),
        py::arg("store_host") = "the process group's store", py::arg("file_numbers") = py::dict(),
        py::arg("keep_other_files") = false, py::arg("numbered_files") = false);
  m.def(
      "forget_gloo_groups", [] { ForgetGlooGroups(); },
      "Drops the Gloo groups kept between operations (torch.distributed was shut down: the groups they served "
      "are gone).");
}

}  // namespace shardcast::binding
