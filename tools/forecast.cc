#include "tools/forecast.h"

#include <algorithm>

namespace shardcast {

std::vector<ForecastRow> Forecast(const Plan& plan, int rank, const LoadOptions& o, const LoadOptions& cuda) {
  const Plan::RankBytes b = plan.LocalBytes(rank);
  const uint64_t shard = b.by_role[static_cast<int>(Role::kParameter)] + b.by_role[static_cast<int>(Role::kSidecar)];
  const uint64_t buffers = b.by_role[static_cast<int>(Role::kPersistentBuffer)] +
                           b.by_role[static_cast<int>(Role::kNonPersistentBuffer)];
  uint64_t model = 0, largest = 0;
  for (const auto& e : plan.entries()) {
    model += e.nbytes();
    largest = std::max(largest, e.nbytes());
  }
  const bool reader = rank == 0;
  const uint64_t c = kForecastConstantBytes, staging = o.staging_bytes(), cuda_staging = cuda.staging_bytes();
  std::vector<ForecastRow> rows;
  rows.push_back({"rank0 -> cpu", shard + buffers + (reader ? staging : 0) + c, 0});
  rows.push_back({"rank0 -> pinned", shard + buffers + (reader ? staging : 0) + c, 0});
  rows.push_back({"rank0 -> cuda", cuda_staging + c, shard + buffers});
  rows.push_back({"each-rank -> cpu", shard + buffers + o.chunk_bytes + c, 0});
  rows.push_back({"each-rank -> cuda", cuda_staging + c, shard + buffers});
  // DCP broadcast_from_rank0 / accelerate: rank 0 holds the state dict, every rank a full copy, and a
  // full tensor in flight.
  rows.push_back({"baseline broadcast -> cpu", (reader ? model : 0) + model + shard + largest + c, 0});
  return rows;
}

}  // namespace shardcast
