// bench/rss_case: one RSS measurement: materialize what a non-rank-0 rank holds under a strategy and
// read what it cost. Runs inside a child process of `shardcast bench-rss`.
//
//   zeros-like  at::zeros for every entry: what loaders do so no rank sees garbage; commits everything
//   empty-like  at::empty: commits nothing, but heap memory can hold an earlier tensor's bytes (NaN)
//   lazy-zero   fresh MAP_NORESERVE mappings: zeros at the cost of empty
//   meta        shardcast's prepare: meta parameters, real buffers (computed or zero)
#pragma once

#include <ATen/core/Tensor.h>

#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "allocators/memory_probe.h"

namespace shardcast::bench {

enum class RssStrategy { kZerosLike, kEmptyLike, kLazyZero, kMeta };
std::optional<RssStrategy> ParseRssStrategy(const std::string& name);
const char* RssStrategyName(RssStrategy s);
bool Commits(RssStrategy s);  // zeros-like: writes every page

struct RssCase {
  std::string config;
  RssStrategy strategy = RssStrategy::kMeta;
  int layers = -1;  // -1: all
};

struct RssCaseResult {
  RssCase c;
  int layers = 0;
  uint64_t params = 0, bytes = 0, entries = 0;
  MemorySnapshot baseline, held;  // after libtorch is loaded; after materializing
  MemoryPeaks peaks;
  double seconds = 0;
  bool peak_reset = false;

  uint64_t anon_above() const { return peaks.rss_anon > baseline.rss_anon ? peaks.rss_anon - baseline.rss_anon : 0; }
  uint64_t file_above() const { return peaks.rss_file > baseline.rss_file ? peaks.rss_file - baseline.rss_file : 0; }
  nlohmann::json ToJson() const;
  static RssCaseResult FromJson(const nlohmann::json& j);
};

// Materializes and measures; the tensors stay alive in *held until the caller drops them.
RssCaseResult RunRssCase(const RssCase& c, std::vector<at::Tensor>* held);

// The NaN demonstration: bf16 values an allocation returned after a NaN-filled tensor of the same
// size was freed. empty-like can return them; lazy-zero never does.
struct NanDemo {
  int64_t elements = 0, empty_nonzero = 0, empty_nan = 0, lazy_nonzero = 0, lazy_nan = 0;
};
NanDemo RunNanDemo();

}  // namespace shardcast::bench
