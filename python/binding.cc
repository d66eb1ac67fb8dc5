// python/binding: the _shardcast extension. Thin: it turns Python arguments into the C++ core's
// types, runs the load without the GIL, and maps every shardcast::Error kind to its own Python
// exception class (the package re-exports them). This file is the module: its exception classes, then
// its parts (binding_internal.h).
#include <torch/csrc/utils/pybind.h>

#include <map>
#include <string>
#include <utility>

#include "allocators/error.h"
#include "python/binding_internal.h"

namespace py = pybind11;

namespace shardcast {
namespace {

std::map<ErrorKind, py::object>& ExceptionTypes() {
  static auto* m = new std::map<ErrorKind, py::object>();
  return *m;
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

  binding::BindProcess(m);
  binding::BindInspection(m);
  binding::BindLoadSave(m);
}
