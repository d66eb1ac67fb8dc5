// python/operation: what a load and a save share: this rank's store, the problem it carries, its entries and
// their layouts (from arguments.h), and the run without the GIL that enters the agreement with them. Used by
// load_save.cc, with the GIL.
#pragma once

#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/utils/pybind.h>

#include <chrono>
#include <exception>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "python/arguments.h"
#include "python/carried.h"
#include "runtime/agree/communicator.h"
#include "runtime/agree/failure.h"
#include "runtime/comm/c10d_communicator.h"
#include "runtime/layout/plan.h"
#include "runtime/materialize/materializer.h"

namespace py = pybind11;

namespace shardcast::binding {

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

}  // namespace shardcast::binding
