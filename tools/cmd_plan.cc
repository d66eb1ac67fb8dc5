// shardcast plan --config FILE --world-size W [--rank R] [--layers N] [--dtype bf16|f16|f32] [--json]
// What the spec holds by role and dtype, what each rank holds, and the forecast peak memory.
#include <CLI/CLI.hpp>
#include <cstdio>
#include <iostream>
#include <map>
#include <nlohmann/json.hpp>

#include "allocators/error.h"
#include "loaders/synth.h"
#include "tools/cli_util.h"
#include "tools/commands.h"
#include "tools/forecast.h"

namespace shardcast::tools {
namespace {

struct PlanArgs {
  std::string config;
  int world_size = 1;
  int rank = -1;
  int layers = -1;
  std::string dtype;  // fp8 block-quantized weights as loaded in this dtype (default: as the config says)
  bool json = false;
};

const Role kRoles[] = {Role::kParameter, Role::kPersistentBuffer, Role::kNonPersistentBuffer, Role::kSidecar};

nlohmann::ordered_json RankJson(const Plan& plan, int r, const LoadOptions& opt) {
  Plan::RankBytes b = plan.LocalBytes(r);
  nlohmann::ordered_json j;
  j["rank"] = r;
  for (Role role : kRoles) j["bytes"][std::string(RoleName(role))] = b.by_role[static_cast<int>(role)];
  j["bytes"]["total"] = b.total();
  auto& none = j["entries_without_rows"] = nlohmann::json::array();
  for (const PlanEntry* e : plan.EntriesWithoutRows(r)) none.push_back(e->key);
  auto& fc = j["forecast"] = nlohmann::json::array();
  for (const ForecastRow& row : Forecast(plan, r, opt)) {
    fc.push_back({{"strategy", row.strategy}, {"host_bytes", row.host_bytes}, {"device_bytes", row.device_bytes}});
  }
  return j;
}

void PrintRanks(const Plan& plan, const std::vector<int>& ranks, const LoadOptions& opt) {
  std::printf("\nper rank (world size %d): bytes after the load\n", plan.world_size());
  std::printf("%5s %14s %14s %14s %12s %14s %9s\n", "rank", "parameters", "persist.buf", "non-persist.", "sidecars",
              "total", "no rows");
  for (int r : ranks) {
    Plan::RankBytes b = plan.LocalBytes(r);
    std::printf("%5d %14s %14s %14s %12s %14s %9zu\n", r, HumanBytes(b.by_role[0]).c_str(), HumanBytes(b.by_role[1]).c_str(),
                HumanBytes(b.by_role[2]).c_str(), HumanBytes(b.by_role[3]).c_str(), HumanBytes(b.total()).c_str(),
                plan.EntriesWithoutRows(r).size());
  }
  for (int r : ranks) {
    auto none = plan.EntriesWithoutRows(r);
    if (none.empty()) continue;
    std::printf("rank %d holds no rows of %zu entries, e.g. %s\n", r, none.size(), none.front()->key.c_str());
  }
  std::printf("\nforecast peak memory (staging %d x %s; a constant of %s per rank)\n", opt.staging_slots,
              HumanBytes(opt.chunk_bytes).c_str(), HumanBytes(kForecastConstantBytes).c_str());
  std::printf("%5s  %-28s %14s %14s\n", "rank", "source -> target", "host", "device");
  for (int r : ranks) {
    for (const ForecastRow& row : Forecast(plan, r, opt)) {
      std::printf("%5d  %-28s %14s %14s\n", r, row.strategy.c_str(), HumanBytes(row.host_bytes).c_str(),
                  row.device_bytes ? HumanBytes(row.device_bytes).c_str() : "-");
    }
  }
}

int RunPlan(const PlanArgs& a) {
  if (a.world_size < 1) {
    throw Error(ErrorKind::kInvalidArgument, "--world-size", "must be at least 1, got " + std::to_string(a.world_size));
  }
  ModelSpec spec = BuildModelSpec(a.config, SpecOptions{a.layers});
  if (!a.dtype.empty()) spec = DequantizedSpec(spec, ParseFloatDType(a.dtype, "--dtype"));
  Plan plan = Plan::Build(spec, a.world_size);
  std::vector<int> ranks;
  if (a.rank >= 0 || a.rank < -1) {
    plan.CheckRank(a.rank);
    ranks.push_back(a.rank);
  } else {
    for (int r = 0; r < a.world_size; ++r) ranks.push_back(r);
  }
  const LoadOptions opt = LoadOptionsFromEnvironment();
  std::map<std::pair<std::string, std::string>, std::pair<uint64_t, uint64_t>> by;  // (role, dtype) -> (n, bytes)
  uint64_t total = 0;
  for (const auto& e : spec.entries) {
    auto& slot = by[{std::string(RoleName(e.role)), std::string(DTypeName(e.dtype))}];
    slot.first += 1;
    slot.second += e.nbytes();
    total += e.nbytes();
  }
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
    auto& rs = out["ranks"] = nlohmann::json::array();
    for (int r : ranks) rs.push_back(RankJson(plan, r, opt));
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
  PrintRanks(plan, ranks, opt);
  return 0;
}

}  // namespace

void AddPlan(CLI::App& app, Runner* run) {
  auto args = std::make_shared<PlanArgs>();
  auto* cmd = app.add_subcommand("plan", "What a model spec holds, what each rank holds, and the forecast peak memory");
  cmd->add_option("--config", args->config, "HF config.json")->required();
  cmd->add_option("--world-size", args->world_size, "number of ranks (default 1)");
  cmd->add_option("--rank", args->rank, "show only this rank (default: all)");
  cmd->add_option("--layers", args->layers, "keep only the first N decoder layers (default: all)");
  cmd->add_option("--dtype", args->dtype,
                  "bf16, f16 or f32: forecast fp8 block-quantized weights loaded (dequantized) in this dtype");
  cmd->add_flag("--json", args->json, "print JSON instead of tables");
  cmd->callback([args, run] { *run = [args] { return RunCommand("plan", [&] { return RunPlan(*args); }); }; });
}

}  // namespace shardcast::tools
