#include "bench/rss_bench.h"

#include <sys/resource.h>
#include <sys/utsname.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <set>

#include "allocators/error.h"
#include "bench/svg_plot.h"
#include "runtime/layout/plan.h"
#include "tools/subprocess.h"

namespace shardcast::bench {
namespace {

constexpr uint64_t kPerProcessOverhead = 200ull << 20;  // libtorch + our own data, per child

uint64_t MemAvailable() {
  std::ifstream in("/proc/meminfo");
  std::string key;
  uint64_t kb = 0;
  std::string unit;
  while (in >> key >> kb >> unit) {
    if (key == "MemAvailable:") return kb * 1024;
  }
  return 0;
}

std::string Gb(uint64_t bytes) {
  char b[32];
  std::snprintf(b, sizeof(b), bytes >= 100e9 ? "%.0f GB" : bytes >= 1e9 ? "%.1f GB" : "%.1f MB",
                bytes >= 1e9 ? bytes / 1e9 : bytes / 1e6);
  return b;
}

uint64_t Above(uint64_t v, uint64_t base) { return v > base ? v - base : 0; }

uint64_t BytesAt(const std::string& config, int layers) {
  ModelSpec s = BuildModelSpec(config, SpecOptions{layers});
  uint64_t b = 0;
  for (const auto& e : s.entries) b += e.nbytes();
  return b;
}

// R children materialize at once; while all hold, read each one's status and sum the node.
PointMeasurement RunPoint(const RssBenchOptions& o, const std::string& config, RssStrategy s, int layers, int procs) {
  PointMeasurement pm;
  pm.layers = layers;
  pm.procs = procs;
  std::vector<Subprocess> children;
  const std::string exe = SelfExe();
  for (int i = 0; i < procs; ++i) {
    SpawnOptions so;
    so.argv = {exe, "__rss-child", config, RssStrategyName(s), std::to_string(layers)};
    so.pipe_stdin = so.pipe_stdout = true;
    children.push_back(Subprocess::Spawn(so));
  }
  for (auto& child : children) {
    auto line = child.ReadLine(o.timeout);
    if (!line || line->empty() || (*line)[0] != '{') {
      int code = child.Wait(std::chrono::seconds(30));
      throw Error(ErrorKind::kInternal, config + " " + RssStrategyName(s),
                  "rss child pid " + std::to_string(child.pid()) + " failed (exit " + std::to_string(code) + ")");
    }
    pm.ranks.push_back(RssCaseResult::FromJson(nlohmann::json::parse(*line)));
  }
  for (size_t i = 0; i < children.size(); ++i) {  // all hold now: one consistent node snapshot
    MemorySnapshot m = ReadMemory(children[i].pid(), o.proc_root);
    pm.node_anon += Above(m.rss_anon, pm.ranks[i].baseline.rss_anon);
    pm.node_file += Above(m.rss_file, pm.ranks[i].baseline.rss_file);
  }
  for (auto& child : children) child.CloseStdin();
  for (auto& child : children) {
    int code = child.Wait(o.timeout);
    if (code != 0) throw Error(ErrorKind::kInternal, config, "rss child exited with " + std::to_string(code));
  }
  pm.bytes = pm.ranks.front().bytes;
  return pm;
}

void FillFromPoint(RssBenchRow* row, const PointMeasurement& pm) {
  for (const auto& r : pm.ranks) {
    row->rank_anon = std::max(row->rank_anon, r.anon_above());
    row->rank_file = std::max(row->rank_file, r.file_above());
    row->rank_vm_size = std::max(row->rank_vm_size, Above(r.peaks.vm_size, r.baseline.vm_size));
    row->seconds = std::max(row->seconds, r.seconds);
  }
  // The node figure is the larger of the simultaneous snapshot and the sum of per-rank peaks.
  uint64_t sum_anon = 0, sum_file = 0;
  for (const auto& r : pm.ranks) sum_anon += r.anon_above(), sum_file += r.file_above();
  row->node_anon = std::max(pm.node_anon, sum_anon);
  row->node_file = std::max(pm.node_file, sum_file);
}

// Least squares of per-process RssAnon above baseline against materialized bytes.
void Fit(const std::vector<PointMeasurement>& pts, double* a, double* b) {
  double n = 0, sx = 0, sy = 0, sxx = 0, sxy = 0;
  for (const auto& p : pts) {
    for (const auto& r : p.ranks) {
      double x = static_cast<double>(p.bytes), y = static_cast<double>(r.anon_above());
      n += 1, sx += x, sy += y, sxx += x * x, sxy += x * y;
    }
  }
  double d = n * sxx - sx * sx;
  *b = d != 0 ? (n * sxy - sx * sy) / d : 1.0;
  *a = (sy - *b * sx) / n;
}

RssBenchRow RunRow(const RssBenchOptions& o, const std::string& config, RssStrategy s) {
  ModelSpec spec = BuildModelSpec(config, SpecOptions{o.layers});
  RssBenchRow row;
  row.config = config;
  row.model_type = spec.model_type;
  row.params = spec.parameter_count();
  row.strategy = s;
  row.ranks = o.ranks_per_node;
  for (const auto& e : spec.entries) row.full_bytes += e.nbytes();
  Plan plan = Plan::Build(spec, o.world_size);
  for (int r = 0; r < o.world_size; ++r) row.shard_bytes = std::max(row.shard_bytes, plan.LocalBytes(r).total());
  const int full_layers = spec.num_layers;
  const double budget = o.memory_fraction * static_cast<double>(MemAvailable());
  const int R = o.ranks_per_node;
  if (!Commits(s) || R * static_cast<double>(row.full_bytes + kPerProcessOverhead) <= budget) {
    row.points.push_back(RunPoint(o, config, s, full_layers, R));
    FillFromPoint(&row, row.points.back());
    return row;
  }
  // Committing and too large: fewest-compromise measurement that fits, then extrapolate.
  int procs = 0, lmax = 0;
  for (int p = R; p >= 1 && procs == 0; --p) {
    for (int l = full_layers; l >= 1; --l) {
      if (p * static_cast<double>(BytesAt(config, l) + kPerProcessOverhead) <= budget) {
        procs = p, lmax = l;
        break;
      }
    }
  }
  if (procs == 0) {
    throw Error(ErrorKind::kUnsupported, config,
                "not even one layer of zeros-like fits in " + Gb(static_cast<uint64_t>(budget)) + " here");
  }
  std::set<int> layer_points = {0, lmax / 2, lmax};
  for (int l : layer_points) row.points.push_back(RunPoint(o, config, s, l, procs));
  Fit(row.points, &row.fit_intercept, &row.fit_slope);
  row.extrapolated = true;
  row.rank_anon = static_cast<uint64_t>(std::max(0.0, row.fit_intercept + row.fit_slope * row.full_bytes));
  uint64_t file = 0;
  for (const auto& p : row.points) {
    for (const auto& r : p.ranks) file = std::max(file, r.file_above());
    row.seconds = std::max(row.seconds, p.ranks.front().seconds * row.full_bytes / std::max<uint64_t>(p.bytes, 1));
  }
  row.rank_file = file;
  row.rank_vm_size = row.rank_anon;
  row.node_anon = row.rank_anon * static_cast<uint64_t>(R);
  row.node_file = file * static_cast<uint64_t>(R);
  return row;
}

std::string Note(const RssBenchRow& r) {
  if (!r.extrapolated) return "measured, " + std::to_string(r.points.front().layers) + " layers";
  std::string ls;
  for (const auto& p : r.points) {
    if (!ls.empty()) ls.push_back(',');
    ls.append(std::to_string(p.layers));
  }
  char b[160];
  std::snprintf(b, sizeof(b), "EXTRAPOLATED from %d proc(s) at layers %s (slope %.3f B/B)", r.points.front().procs,
                ls.c_str(), r.fit_slope);
  return b;
}

nlohmann::json RowJson(const RssBenchRow& r) {
  nlohmann::json pts = nlohmann::json::array();
  for (const auto& p : r.points) {
    nlohmann::json ranks = nlohmann::json::array();
    for (const auto& x : p.ranks) ranks.push_back(x.ToJson());
    pts.push_back({{"layers", p.layers}, {"procs", p.procs}, {"bytes_per_process", p.bytes},
                   {"node_rss_anon_above_baseline", p.node_anon}, {"node_rss_file_above_baseline", p.node_file},
                   {"ranks", ranks}});
  }
  return {{"config", r.config}, {"model_type", r.model_type}, {"params", r.params}, {"model_bytes", r.full_bytes},
          {"strategy", RssStrategyName(r.strategy)}, {"ranks_per_node", r.ranks},
          {"extrapolated", r.extrapolated}, {"fit", {{"intercept_bytes", r.fit_intercept}, {"slope", r.fit_slope}}},
          {"per_rank", {{"peak_rss_anon", r.rank_anon}, {"peak_rss_file", r.rank_file}, {"vm_size", r.rank_vm_size},
                        {"seconds", r.seconds}}},
          {"node", {{"peak_rss_anon", r.node_anon}, {"peak_rss_file", r.node_file}}},
          {"shard_bytes_after_load", r.shard_bytes}, {"points", pts}};
}

nlohmann::json MachineJson() {
  struct utsname u;
  uname(&u);
  std::ifstream cpu("/proc/cpuinfo");
  std::string line, model;
  while (std::getline(cpu, line)) {
    if (line.rfind("model name", 0) == 0) {
      model = line.substr(line.find(':') + 2);
      break;
    }
  }
  return {{"cpus", sysconf(_SC_NPROCESSORS_ONLN)}, {"cpu", model}, {"kernel", u.release},
          {"mem_total_bytes", static_cast<uint64_t>(sysconf(_SC_PHYS_PAGES)) * sysconf(_SC_PAGESIZE)},
          {"mem_available_bytes", MemAvailable()}};
}

void CheckCanSpawn(const RssBenchOptions& o) {
  struct rlimit rl;
  uint64_t limit = 4096;
  if (getrlimit(RLIMIT_NPROC, &rl) == 0 && rl.rlim_cur != RLIM_INFINITY) limit = std::min<uint64_t>(limit, rl.rlim_cur / 2);
  limit = std::min<uint64_t>(limit, MemAvailable() / kPerProcessOverhead);
  if (o.ranks_per_node < 1 || static_cast<uint64_t>(o.ranks_per_node) > limit) {
    throw Error(ErrorKind::kInvalidArgument, "--ranks-per-node",
                std::to_string(o.ranks_per_node) + " is beyond what this machine can spawn (1 to " +
                    std::to_string(limit) + ": RLIMIT_NPROC and " + Gb(kPerProcessOverhead) + " per process)");
  }
}

}  // namespace

uint64_t PointMeasurement::MaxAnonAbove() const {
  uint64_t m = 0;
  for (const auto& r : ranks) m = std::max(m, r.anon_above());
  return m;
}
uint64_t PointMeasurement::MaxFileAbove() const {
  uint64_t m = 0;
  for (const auto& r : ranks) m = std::max(m, r.file_above());
  return m;
}

int RssChildMain(const std::string& config, const std::string& strategy, int layers) {
  auto s = ParseRssStrategy(strategy);
  if (!s) return 2;
  std::vector<at::Tensor> held;
  RssCaseResult r = RunRssCase(RssCase{config, *s, layers}, &held);
  std::cout << r.ToJson().dump() << std::endl;
  char c;
  while (std::cin.get(c)) {
  }  // hold until the parent closes our stdin
  return 0;
}

std::vector<RssBenchRow> RunRssBench(const RssBenchOptions& o) {
  try {
    ReadMemory(0, o.proc_root);
  } catch (const Error& e) {
    throw Error(ErrorKind::kUnsupported, "memory probe", std::string("unavailable: ") + e.what());
  }
  CheckCanSpawn(o);
  for (const auto& c : o.configs) BuildModelSpec(c, SpecOptions{o.layers});  // bad config: fail before any work
  std::vector<RssBenchRow> rows;
  std::printf("%-16s %9s %-11s %13s %13s %11s %15s %8s %11s  %s\n", "model", "params", "strategy", "rank RssAnon",
              "rank RssFile", "rank VmSize", "node RssAnon", "time", "shard/rank", "source");
  for (const auto& config : o.configs) {
    for (RssStrategy s : o.strategies) {
      RssBenchRow r = RunRow(o, config, s);
      char params[32];
      std::snprintf(params, sizeof(params), "%.1f B", r.params / 1e9);
      std::printf("%-16s %9s %-11s %13s %13s %11s %15s %7.2fs %11s  %s\n", r.model_type.c_str(), params,
                  RssStrategyName(s), Gb(r.rank_anon).c_str(), Gb(r.rank_file).c_str(), Gb(r.rank_vm_size).c_str(),
                  (Gb(r.node_anon) + (r.extrapolated ? "*" : "")).c_str(), r.seconds, Gb(r.shard_bytes).c_str(),
                  Note(r).c_str());
      std::fflush(stdout);
      rows.push_back(std::move(r));
    }
  }
  std::printf("\nRSS figures are peaks above each process's baseline after libtorch is loaded; node = %d local ranks; "
              "* = extrapolated. shard/rank: what each of %d ranks holds after a shardcast load.\n",
              o.ranks_per_node, o.world_size);
  for (const auto& config : o.configs) {  // the node ratios against zeros-like
    const RssBenchRow* zeros = nullptr;
    for (const auto& r : rows) zeros = (r.config == config && r.strategy == RssStrategy::kZerosLike) ? &r : zeros;
    if (zeros == nullptr || zeros->node_anon == 0) continue;
    for (const auto& r : rows) {
      if (r.config != config || &r == zeros) continue;
      std::printf("%s: %s node RssAnon is %.4f%% of zeros-like's%s\n", r.model_type.c_str(), RssStrategyName(r.strategy),
                  100.0 * r.node_anon / zeros->node_anon, zeros->extrapolated ? " (extrapolated)" : "");
    }
  }
  NanDemo nan = RunNanDemo();
  std::printf("NaN demonstration: after freeing a NaN-filled bf16 tensor of %lld elements, empty-like returned %lld "
              "non-zero values (%lld NaN); lazy-zero returned %lld (%lld NaN).\n",
              static_cast<long long>(nan.elements), static_cast<long long>(nan.empty_nonzero),
              static_cast<long long>(nan.empty_nan), static_cast<long long>(nan.lazy_nonzero),
              static_cast<long long>(nan.lazy_nan));
  if (!o.json_out.empty()) {
    nlohmann::json j;
    j["machine"] = MachineJson();
    j["ranks_per_node"] = o.ranks_per_node;
    j["world_size"] = o.world_size;
    j["rows"] = nlohmann::json::array();
    for (const auto& r : rows) j["rows"].push_back(RowJson(r));
    j["nan_demonstration"] = {{"elements", nan.elements}, {"empty_like_nonzero", nan.empty_nonzero},
                              {"empty_like_nan", nan.empty_nan}, {"lazy_zero_nonzero", nan.lazy_nonzero},
                              {"lazy_zero_nan", nan.lazy_nan}};
    std::ofstream(o.json_out) << j.dump(2) << "\n";
  }
  if (!o.plot_out.empty()) {
    std::vector<PlotSeries> series;
    for (RssStrategy s : o.strategies) {
      PlotSeries ps{RssStrategyName(s), {}};
      for (const auto& r : rows) {
        if (r.strategy != s) continue;
        ps.points.push_back({r.params / 1e9, std::max(r.node_anon / 1e9, 1e-3), r.extrapolated, r.model_type});
      }
      series.push_back(ps);
    }
    std::ofstream(o.plot_out) << LogLogSvg(
        "Peak host RssAnon per node (" + std::to_string(o.ranks_per_node) + " ranks) vs model size",
        "model parameters (billions)", "node peak RssAnon (GB, above baseline)", series,
        "Hollow markers: extrapolated from smaller measured layer counts. Values below 1 MB drawn at 1 MB.");
  }
  return rows;
}

}  // namespace shardcast::bench
