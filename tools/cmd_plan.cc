// shardcast plan --config FILE --world-size W [--json]: what a spec holds, by role and dtype.
#include <CLI/CLI.hpp>
#include <cstdio>
#include <iostream>
#include <map>
#include <nlohmann/json.hpp>

#include "allocators/error.h"
#include "loaders/model_spec.h"
#include "tools/cli_util.h"

namespace shardcast::tools {
namespace {

struct PlanArgs {
  std::string config;
  int world_size = 1;
  int layers = -1;
  bool json = false;
};

int Plan(const PlanArgs& a) {
  if (a.world_size < 1) {
    throw Error(ErrorKind::kInvalidArgument, "--world-size", "must be at least 1, got " + std::to_string(a.world_size));
  }
  ModelSpec spec = BuildModelSpec(a.config, SpecOptions{a.layers});
  std::map<std::pair<std::string, std::string>, std::pair<uint64_t, uint64_t>> by;  // (role, dtype) -> (n, bytes)
  for (const auto& e : spec.entries) {
    auto& slot = by[{std::string(RoleName(e.role)), std::string(DTypeName(e.dtype))}];
    slot.first += 1;
    slot.second += e.nbytes();
  }
  uint64_t total = 0;
  for (const auto& [k, v] : by) total += v.second;
  if (a.json) {
    nlohmann::ordered_json out;
    out["config"] = a.config;
    out["model_type"] = spec.model_type;
    out["layers"] = spec.num_layers;
    out["parameters"] = spec.parameter_count();
    out["entries"] = spec.entries.size();
    out["total_bytes"] = total;
    out["world_size"] = a.world_size;
    auto& groups = out["by_role_and_dtype"] = nlohmann::json::array();
    for (const auto& [k, v] : by) {
      groups.push_back({{"role", k.first}, {"dtype", k.second}, {"entries", v.first}, {"bytes", v.second}});
    }
    std::cout << out.dump(2) << "\n";
    return 0;
  }
  std::printf("%s: %s, %d layers, %zu entries, %s parameters, %s in all\n", a.config.c_str(), spec.model_type.c_str(),
              spec.num_layers, spec.entries.size(), HumanCount(spec.parameter_count()).c_str(), HumanBytes(total).c_str());
  std::printf("%-22s %-8s %9s %18s %12s\n", "role", "dtype", "entries", "bytes", "");
  for (const auto& [k, v] : by) {
    std::printf("%-22s %-8s %9llu %18llu %12s\n", k.first.c_str(), k.second.c_str(),
                static_cast<unsigned long long>(v.first), static_cast<unsigned long long>(v.second),
                HumanBytes(v.second).c_str());
  }
  return 0;
}

}  // namespace

void AddPlan(CLI::App& app, Runner* run) {
  auto args = std::make_shared<PlanArgs>();
  auto* cmd = app.add_subcommand("plan", "Show what a model spec holds, and (per rank) what each rank will hold");
  cmd->add_option("--config", args->config, "HF config.json")->required();
  cmd->add_option("--world-size", args->world_size, "number of ranks (default 1)");
  cmd->add_option("--layers", args->layers, "keep only the first N decoder layers (default: all)");
  cmd->add_flag("--json", args->json, "print JSON instead of a table");
  cmd->callback([args, run] { *run = [args] { return RunCommand("plan", [&] { return Plan(*args); }); }; });
}

}  // namespace shardcast::tools
