// python/process: this process's own services, outside any load or save: page-cache prefetch, the test
// fault points, lazily zeroed tensors, the launcher's environment, the CPU quota, buffers' locally
// computed values, and the probe of a store that stopped answering.
#include <torch/csrc/utils/pybind.h>

#include <ATen/ops/empty_like.h>

#include <cstdint>
#include <fcntl.h>
#include <string>
#include <sys/stat.h>
#include <vector>

#include <nlohmann/json.hpp>

#include "allocators/error.h"
#include "allocators/tensor_alloc.h"
#include "loaders/posix_file.h"
#include "python/binding_internal.h"
#include "runtime/agree/communicator.h"
#include "runtime/agree/fault.h"
#include "runtime/agree/verdict.h"
#include "runtime/comm/store_channel.h"
#include "runtime/cpu_quota.h"
#include "runtime/materialize/buffer_init.h"

namespace py = pybind11;

namespace shardcast::binding {

void BindProcess(py::module_& m) {
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
  m.def("verdict_text", &VerdictText, py::arg("failed"), py::arg("messages"), py::arg("world"),
        "A verdict's words, as every agreement raises them (runtime/agree/verdict.h): \"failed on rank(s) ... of "
        "W:\" with the runs of `failed` (ascending) as ranges, then each of the first len(messages) ranks' "
        "message, then how many more failed unshown.");
  m.def(
      "store_resolve", [](const std::string& addr, int port) { return Resolved(StoreAddress{addr, port}).numeric; },
      py::arg("addr"), py::arg("port"), py::call_guard<py::gil_scoped_release>(),
      "addr's numeric addresses (within 1.5 s; [] where it cannot be resolved), resolved once while the store "
      "answers, for store_refuses (runtime/comm/store_channel.h, Resolved).");
  m.def(
      "store_refuses",
      [](const std::string& addr, int port, std::vector<std::string> numeric) {
        return StoreRefuses(StoreAddress{addr, port, std::move(numeric)});
      },
      py::arg("addr"), py::arg("port"), py::arg("numeric") = std::vector<std::string>{},
      py::call_guard<py::gil_scoped_release>(),
      "Whether a TCP connection to addr:port is refused within 0.5 s on every address it has (`numeric`, from "
      "store_resolve, else the name's): the host is up and nothing listens there, so a store served from that "
      "port is gone (runtime/comm/store_channel.h, StoreRefuses). False where one is accepted or not answered "
      "in time (a frozen server), or not known.");
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
}

}  // namespace shardcast::binding
