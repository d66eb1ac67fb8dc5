// bench/rss_bench: `shardcast bench-rss`, peak host memory by materialization strategy and model.
//
// Each case runs as R real child processes (the local ranks of one node) that materialize at once;
// while all of them hold their memory, the parent reads every child's /proc/<pid>/status and sums
// the node. Strategies that commit nothing run at full model scale. zeros-like, which commits every
// byte, runs at layer counts (and, if needed, fewer processes) that fit this machine, and its
// full-scale figures are extrapolated from a least-squares fit of measured RssAnon against
// materialized bytes; they are marked "extrapolated" in every output.
#pragma once

#include <chrono>
#include <string>
#include <vector>

#include "bench/rss_case.h"

namespace shardcast::bench {

struct RssBenchOptions {
  std::vector<std::string> configs;           // HF config.json files
  std::vector<RssStrategy> strategies = {RssStrategy::kZerosLike, RssStrategy::kEmptyLike, RssStrategy::kLazyZero,
                                         RssStrategy::kMeta};  // default: all four
  int world_size = 8;                         // default 8: for the "shard after load" column
  int ranks_per_node = 8;                     // default 8: child processes per case
  int layers = -1;                            // default -1: full model for non-committing strategies
  double memory_fraction = 0.5;               // default 0.5 of MemAvailable for committing cases
  std::string json_out, plot_out;             // default none
  std::chrono::milliseconds timeout{10 * 60 * 1000};  // default 10 min per case
  std::string proc_root = "/proc";            // default /proc (SHARDCAST_PROC_ROOT overrides)
};

struct PointMeasurement {  // one layer count of one case
  int layers = 0, procs = 0;
  uint64_t bytes = 0;                      // materialized bytes per process
  std::vector<RssCaseResult> ranks;        // each child's own report
  uint64_t node_anon = 0, node_file = 0;   // sum over children, above their baselines, read while all hold
  uint64_t MaxAnonAbove() const;
  uint64_t MaxFileAbove() const;
};

struct RssBenchRow {
  std::string config, model_type;
  uint64_t params = 0, full_bytes = 0, shard_bytes = 0;  // shard: the largest rank's after loading, W ranks
  RssStrategy strategy = RssStrategy::kMeta;
  int ranks = 0;
  std::vector<PointMeasurement> points;
  bool extrapolated = false;
  double fit_intercept = 0, fit_slope = 0;  // per-process RssAnon = a + b * bytes (extrapolated rows)
  uint64_t rank_anon = 0, rank_file = 0, rank_vm_size = 0, node_anon = 0, node_file = 0;
  double seconds = 0;
};

// The entry point of the CLI's bench-rss; returns the rows it printed.
std::vector<RssBenchRow> RunRssBench(const RssBenchOptions& options);

// The hidden child mode: `shardcast __rss-child CONFIG STRATEGY LAYERS` prints one JSON line, then
// holds its memory until stdin closes.
int RssChildMain(const std::string& config, const std::string& strategy, int layers);

}  // namespace shardcast::bench
