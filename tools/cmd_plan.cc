// shardcast plan --config FILE --world-size W [--rank R] [--layers N] [--dtype bf16|f16|f32] [--json]
// What the spec holds by role and dtype, what each rank holds, and the forecast peak memory.
//
// shardcast plan ... --rank R --schedule [--replicas R] [--tp T] [--source S] [--checkpoint DIR] [--whole]
// Rank R's setup of a load, in this process with no other ranks: its plan, the manifest (the checkpoint
// opened and resolved, as rank 0 does, then released: rank R holds no parsed checkpoint; a sparse
// synthetic one of the spec when no --checkpoint), the manifest checked against its plan, and a walk of its part of the schedule (the whole schedule with
// --whole: what every rank walked before it derived its own). Prints its messages, bytes, the seconds
// (wall and CPU) of each step and the peak RSS (VmHWM, from /proc).
#include <time.h>

#include <CLI/CLI.hpp>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>

#include "allocators/error.h"
#include "allocators/memory_probe.h"
#include "loaders/synth.h"
#include "runtime/layout/parallel_plan.h"
#include "runtime/manifest/manifest.h"
#include "runtime/stream/route.h"
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
  // --schedule: rank R's setup
  bool schedule = false;
  bool whole = false;       // walk every rank's messages (before: what each rank did)
  int replicas = 1;         // HSDP: (Replicate(), Shard(0)) on (replicas, W / replicas)
  int tp = 1;               // TP and EP over T ranks, FSDP over the rest (runtime/layout/parallel_plan.h)
  std::string source = "striped";
  int ranks_per_node = 8;   // the node map node-leader routes by
  std::string checkpoint;   // default: a sparse synthetic checkpoint of the spec, in a temporary directory
};

const Role kRoles[] = {Role::kParameter, Role::kPersistentBuffer, Role::kNonPersistentBuffer, Role::kSidecar};

nlohmann::ordered_json RankJson(const Plan& plan, int r, const LoadOptions& opt, const LoadOptions& cuda) {
  Plan::RankBytes b = plan.LocalBytes(r);
  nlohmann::ordered_json j;
  j["rank"] = r;
  for (Role role : kRoles) j["bytes"][std::string(RoleName(role))] = b.by_role[static_cast<int>(role)];
  j["bytes"]["total"] = b.total();
  auto& none = j["entries_without_rows"] = nlohmann::json::array();
  for (const PlanEntry* e : plan.EntriesWithoutRows(r)) none.push_back(e->key);
  auto& fc = j["forecast"] = nlohmann::json::array();
  for (const ForecastRow& row : Forecast(plan, r, opt, cuda)) {
    fc.push_back({{"strategy", row.strategy}, {"host_bytes", row.host_bytes}, {"device_bytes", row.device_bytes}});
  }
  return j;
}

void PrintRanks(const Plan& plan, const std::vector<int>& ranks, const LoadOptions& opt, const LoadOptions& cuda) {
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
  std::printf("\nforecast peak memory (staging %d x %s, onto a GPU %d x %s; a constant of %s per rank)\n",
              opt.staging_slots, HumanBytes(opt.chunk_bytes).c_str(), cuda.staging_slots,
              HumanBytes(cuda.chunk_bytes).c_str(), HumanBytes(kForecastConstantBytes).c_str());
  std::printf("%5s  %-28s %14s %14s\n", "rank", "source -> target", "host", "device");
  for (int r : ranks) {
    for (const ForecastRow& row : Forecast(plan, r, opt, cuda)) {
      std::printf("%5d  %-28s %14s %14s\n", r, row.strategy.c_str(), HumanBytes(row.host_bytes).c_str(),
                  row.device_bytes ? HumanBytes(row.device_bytes).c_str() : "-");
    }
  }
}

// Wall and CPU seconds of a step.
class Stopwatch {
 public:
  Stopwatch() : wall_(std::chrono::steady_clock::now()), cpu_(Cpu()) {}
  std::pair<double, double> Lap() {
    const auto wall = std::chrono::steady_clock::now();
    const double cpu = Cpu();
    const std::pair<double, double> out{std::chrono::duration<double>(wall - wall_).count(), cpu - cpu_};
    wall_ = wall, cpu_ = cpu;
    return out;
  }

 private:
  static double Cpu() {
    timespec t{};
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
    return static_cast<double>(t.tv_sec) + static_cast<double>(t.tv_nsec) * 1e-9;
  }
  std::chrono::steady_clock::time_point wall_;
  double cpu_;
};

Source ParseSource(const std::string& name) {
  for (Source s : {Source::kRank0, Source::kEachRank, Source::kNodeLeader, Source::kStriped}) {
    if (name == SourceName(s)) return s;
  }
  throw Error(ErrorKind::kInvalidArgument, "--source", "rank0, each-rank, node-leader or striped, got '" + name + "'");
}

// A directory removed with everything in it when the command ends.
struct TempDir {
  std::string path;
  TempDir() {
    std::string pattern = (std::filesystem::temp_directory_path() / "shardcast-plan-XXXXXX").string();
    if (mkdtemp(pattern.data()) == nullptr) throw Error(ErrorKind::kIo, pattern, "cannot create a temporary directory");
    path = pattern;
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path, ec);
  }
};

ModelSpec SpecOf(const PlanArgs& a) {
  ModelSpec spec = BuildModelSpec(a.config, SpecOptions{a.layers});
  if (!a.dtype.empty()) spec = DequantizedSpec(spec, ParseFloatDType(a.dtype, "--dtype"));
  return spec;
}

int RunSchedule(const PlanArgs& a) {
  if (a.rank < 0 || a.rank >= a.world_size) {
    throw Error(ErrorKind::kInvalidArgument, "--rank", "--schedule needs a rank in [0, " + std::to_string(a.world_size) + ")");
  }
  const int world = a.world_size, rank = a.rank;
  const Source source = ParseSource(a.source);
  std::optional<TempDir> synth;
  std::string ckpt_dir = a.checkpoint;
  if (ckpt_dir.empty()) {  // not part of the setup: the files a real load finds
    synth.emplace();
    SynthOptions so;
    so.sparse = true;
    so.max_shard_bytes = 5ull << 30;
    WriteSynthCheckpoint(SpecOf(a), synth->path, so);
    ckpt_dir = synth->path;
  }
  const bool reset = ResetPeak();
  const uint64_t rss0 = ReadMemory().vm_rss;
  const std::string layout = a.tp > 1 ? "tp" + std::to_string(a.tp) + (a.replicas > 1 ? "-hsdp" : "")
                             : a.replicas > 1 ? "hsdp" : "fsdp";
  nlohmann::ordered_json out;
  out["config"] = a.config;
  out["world_size"] = world, out["rank"] = rank, out["layout"] = layout;
  out["replicas"] = a.replicas, out["tp"] = a.tp, out["source"] = a.source, out["whole"] = a.whole;
  Stopwatch clock, total;
  auto step = [&](const char* name) {
    const auto [wall, cpu] = clock.Lap();
    out["steps"][name] = {{"seconds", wall}, {"cpu_seconds", cpu}, {"rss_bytes", ReadMemory().vm_rss}};
  };
  ModelSpec spec = SpecOf(a);
  const BlockSize block = ConfigWeightBlockSize(spec.source, spec.config_json).value_or(BlockSize{});
  step("spec");
  PlanOptions po = a.tp > 1 ? ParallelPlan(spec, world, ParallelSizes{a.replicas, a.tp}) : PlanOptions{a.replicas, {}, {}};
  Plan plan = Plan::Build(std::move(spec), world, po);
  step("plan");
  OpenOptions headers_only;  // pread: no map of every file (the address space of the whole checkpoint)
  headers_only.mode = ReadMode::kPread;
  auto ckpt = Checkpoint::Open(ckpt_dir, headers_only);
  LoadOptions lo = LoadOptionsFromEnvironment();
  lo.source = source;
  Manifest m = Resolve(plan, *ckpt, KeyMapping{}, StreamParamsFrom(lo), block);
  ckpt.reset();  // rank 0's: the manifest holds all that rank 5 needs of it (it opens no headers)
  step("resolve");
  const std::string problem = CheckManifest(m, plan, rank, world);
  if (!problem.empty()) throw Error(ErrorKind::kManifestMismatch, "rank " + std::to_string(rank), problem);
  step("check");
  NodeMap nodes;
  for (int r = 0; r < world; ++r) nodes.node_of_rank.push_back(r / std::max(1, a.ranks_per_node));
  const auto route = Route::Make(source, world, nodes);
  const bool verify = m.params.verify;
  Schedule schedule(m, a.whole ? Interest{} : route->InterestOf(rank, verify));
  Message msg;
  uint64_t messages = 0, segments = 0, read = 0, received = 0, kept = 0, walked = 0;
  while (schedule.Next(&msg)) {
    ++walked;
    const Task t = route->For(msg, rank, verify);
    if (!t.any()) continue;
    ++messages;
    segments += msg.segments.size();
    if (t.read) read += msg.target_bytes;
    if (t.receive || (t.broadcast && !t.read)) received += msg.target_bytes;
    if (t.keep) kept += msg.target_bytes;
  }
  step("schedule");
  const auto [wall, cpu] = total.Lap();
  const MemorySnapshot mem = ReadMemory();
  out["entries"] = m.entries.size();
  out["messages"] = messages, out["messages_walked"] = walked, out["segments"] = segments;
  out["bytes_read"] = read, out["bytes_received"] = received, out["bytes_kept"] = kept;
  out["seconds"] = wall, out["cpu_seconds"] = cpu;
  out["peak_rss_bytes"] = mem.vm_hwm, out["baseline_rss_bytes"] = rss0, out["peak_was_reset"] = reset;
  out["peak_rss_above_baseline_bytes"] = mem.vm_hwm > rss0 ? mem.vm_hwm - rss0 : 0;
  if (a.json) {
    std::cout << out.dump(2) << "\n";
    return 0;
  }
  std::printf("rank %d of %d (%s, source %s%s): %llu messages (%llu walked), %s read, %s received, %s kept\n", rank,
              world, layout.c_str(), a.source.c_str(), a.whole ? ", whole schedule" : "",
              static_cast<unsigned long long>(messages), static_cast<unsigned long long>(walked), HumanBytes(read).c_str(),
              HumanBytes(received).c_str(), HumanBytes(kept).c_str());
  for (const auto& [name, v] : out["steps"].items()) {
    std::printf("  %-9s %8.3f s  %8.3f s CPU  RSS after: %s\n", name.c_str(), v["seconds"].get<double>(),
                v["cpu_seconds"].get<double>(), HumanBytes(v["rss_bytes"].get<uint64_t>()).c_str());
  }
  std::printf("  %-9s %8.3f s  %8.3f s CPU; peak RSS %s (%s above the %s at the start%s)\n", "setup", wall, cpu,
              HumanBytes(mem.vm_hwm).c_str(), HumanBytes(mem.vm_hwm > rss0 ? mem.vm_hwm - rss0 : 0).c_str(),
              HumanBytes(rss0).c_str(), reset ? "" : "; the peak could not be reset");
  return 0;
}

int RunPlan(const PlanArgs& a) {
  if (a.world_size < 1) {
    throw Error(ErrorKind::kInvalidArgument, "--world-size", "must be at least 1, got " + std::to_string(a.world_size));
  }
  if (a.schedule) return RunSchedule(a);
  ModelSpec spec = SpecOf(a);
  Plan plan = Plan::Build(spec, a.world_size);
  std::vector<int> ranks;
  if (a.rank >= 0 || a.rank < -1) {
    plan.CheckRank(a.rank);
    ranks.push_back(a.rank);
  } else {
    for (int r = 0; r < a.world_size; ++r) ranks.push_back(r);
  }
  // The host rows' options and the GPU rows' (a CUDA target's staging defaults differ), each from the
  // environment's SHARDCAST_* variables.
  const LoadOptions opt = LoadOptionsBuilder().FromEnvironment().Set(Option::kTarget, "cpu", "plan").Build();
  const LoadOptions cuda = LoadOptionsBuilder().FromEnvironment().Set(Option::kTarget, "cuda", "plan").Build();
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
    for (int r : ranks) rs.push_back(RankJson(plan, r, opt, cuda));
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
  PrintRanks(plan, ranks, opt, cuda);
  return 0;
}

}  // namespace

void AddPlan(CLI::App& app, Runner* run) {
  auto args = std::make_shared<PlanArgs>();
  auto* cmd = app.add_subcommand("plan", "What a model spec holds, what each rank holds, and the forecast peak memory");
  cmd->add_option("--config", args->config, "HF config.json")->required();
  cmd->add_option("--world-size", args->world_size, "number of ranks (default 1)");
  cmd->add_option("--rank", args->rank, "show only this rank (default: all)")->check(CLI::Range(0, 1 << 30));
  cmd->add_option("--layers", args->layers, "keep only the first N decoder layers (default: all)")->check(CLI::Range(0, 1 << 30));
  cmd->add_option("--dtype", args->dtype,
                  "bf16, f16 or f32: forecast fp8 block-quantized weights loaded (dequantized) in this dtype");
  cmd->add_flag("--json", args->json, "print JSON instead of tables");
  cmd->add_flag("--schedule", args->schedule,
                "rank --rank's setup in this process: plan, manifest (resolved), check, its part of the schedule");
  cmd->add_flag("--whole", args->whole, "with --schedule: walk every rank's messages, as each rank did before");
  cmd->add_option("--replicas", args->replicas, "with --schedule: HSDP replica groups (default 1: FSDP)");
  cmd->add_option("--tp", args->tp, "with --schedule: TP and EP over T ranks, FSDP over the rest (default 1)");
  cmd->add_option("--source", args->source, "with --schedule: rank0, each-rank, node-leader or striped (default striped)");
  cmd->add_option("--ranks-per-node", args->ranks_per_node, "with --schedule: for node-leader (default 8)");
  cmd->add_option("--checkpoint", args->checkpoint,
                  "with --schedule: resolve against this checkpoint (default: a sparse synthetic one of the spec)");
  cmd->callback([args, run] { *run = [args] { return RunCommand("plan", [&] { return RunPlan(*args); }); }; });
}

}  // namespace shardcast::tools
