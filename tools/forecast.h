// tools/forecast: peak host (and device) memory a rank should see, by source and target, from the
// Plan alone. Arithmetic, not measurement: benchmarks measure; this says what to expect.
//
//   reader (rank 0, source rank0)   own shard + buffers + staging ring + constant
//   other ranks                     own shard + buffers + constant
//   baseline (full-tensor broadcast) full model on every rank (+ rank 0's state dict)
#pragma once

#include <string>
#include <vector>

#include "runtime/layout/plan.h"
#include "runtime/load_options.h"

namespace shardcast {

inline constexpr uint64_t kForecastConstantBytes = 64ull << 20;  // allocator, manifest, c10d, page slack

struct ForecastRow {
  std::string strategy;    // "rank0 -> cpu", "baseline broadcast -> cpu", ...
  uint64_t host_bytes = 0;
  uint64_t device_bytes = 0;
};

// `host`: the options of a load onto the host (cpu, pinned); `cuda`: of a load onto the GPU, whose staging
// defaults differ (LoadOptionsBuilder::Build).
std::vector<ForecastRow> Forecast(const Plan& plan, int rank, const LoadOptions& host, const LoadOptions& cuda);

}  // namespace shardcast
