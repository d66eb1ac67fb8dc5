// bench/raw_scatter: the communication cost of the rank0 source alone, on the same communicator: rank 0
// sends every other rank its share of `total_bytes` in chunk-sized messages (staging_slots in flight,
// from buffers filled once), and each rank receives into freshly mapped memory, as a shard is; rank 0
// copies its own share into fresh memory. No file is read: a load over the same bytes can at best
// match this.
#pragma once

#include <cstdint>

#include "runtime/agree/communicator.h"

namespace shardcast::bench {

struct ScatterResult {
  uint64_t bytes = 0;      // landed in fresh memory, over all ranks
  double seconds = 0;      // the slowest rank
  uint64_t checksum = 0;   // of what this rank received, against a pattern (0: every byte right)
};

// Every rank calls it together. REQUIRES: chunk_bytes > 0, staging_slots >= 2.
ScatterResult RawScatter(Communicator& comm, uint64_t total_bytes, uint64_t chunk_bytes, int staging_slots);

}  // namespace shardcast::bench
