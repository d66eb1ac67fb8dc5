// python/binding_internal: the parts the _shardcast module is made of. binding.cc adds the exception
// classes, then each part below in this order; each Bind* adds its part's functions to the module.
#pragma once

#include <torch/csrc/utils/pybind.h>

namespace shardcast::binding {

// process.cc: this process's own services, outside any load or save: page-cache prefetch, test fault
// points, lazily zeroed tensors, the launcher's environment, the CPU quota, buffers' local values.
void BindProcess(pybind11::module_& m);

// inspect.cc: checkpoint files, their headers, tensors and quantized formats, and a layout's pieces,
// read by the loader's own code.
void BindInspection(pybind11::module_& m);

// load_save.cc: the sharded load and save, and what their options resolve to.
void BindLoadSave(pybind11::module_& m);

}  // namespace shardcast::binding
