// python/inspect: what Python reads without loading, by the loader's own code so that the package keeps no
// parser of its own: a checkpoint's names, its files' headers and tensors, each tensor's quantized format,
// and the piece of a tensor a rank holds under a layout.
#include <torch/csrc/utils/pybind.h>

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <fcntl.h>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "loaders/checkpoint.h"
#include "loaders/dtype.h"
#include "loaders/posix_file.h"
#include "loaders/quant/format.h"
#include "loaders/safetensors_file.h"
#include "python/arguments.h"
#include "python/binding_internal.h"
#include "runtime/layout/layout.h"
#include "runtime/layout/plan.h"
#include "runtime/materialize/torch_dtype.h"

namespace py = pybind11;

namespace shardcast::binding {
namespace {

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

}  // namespace

void BindInspection(py::module_& m) {
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
          if (own < 0) {
            throw Error(ErrorKind::kIo, where, std::string("cannot duplicate its descriptor: ") + strerror(errno));
          }
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
          std::optional<DType> dtype =
              py::isinstance<py::str>(t[1])
                  ? ParseDType(t[1].cast<std::string>())
                  : FromScalarType(Cast<at::ScalarType>(t[1], where, "a dtype name or torch.dtype"));
          // A dtype safetensors lacks is no format's: not stored.
          if (dtype) stored[key] = {*dtype, Cast<std::vector<uint64_t>>(t[2], where, "a shape (list of sizes)")};
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
}

}  // namespace shardcast::binding
