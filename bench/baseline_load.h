// bench/baseline_load: the algorithm shardcast replaces, implemented faithfully on the same
// communicator, so the load benchmark compares algorithms and nothing else.
//
// As PyTorch DCP's broadcast_from_rank0 and accelerate's fsdp2_load_full_state_dict do it:
//   - rank 0 reads the full state dict into anonymous memory;
//   - every other rank holds a zeros-like full copy of the model;
//   - every full tensor is broadcast from rank 0, one tensor at a time;
//   - each rank copies its rows out of the full tensor into its shard.
#pragma once

#include <string>

#include "runtime/load.h"

namespace shardcast::bench {

LoadReport BaselineLoad(Communicator& comm, RankState* state, const std::string& checkpoint);

// Reads every data byte of a checkpoint with pread: the I/O reference.
struct PreadResult {
  uint64_t bytes = 0;
  double seconds = 0;
  double cpu_seconds = 0;  // user + system, over every reading process
};
// fresh: read into newly mapped memory (lazy-zero, first touch zeroes it, as a shard's does) instead
// of one reused buffer; the ceiling for any loader that lands bytes in fresh memory.
// nproc > 1: that many processes started together, each reading its contiguous 1/nproc of the data
// bytes and holding them until the last is done (each-rank's load at that world size, with nothing
// but the reads); seconds from the start to the last process done.
PreadResult PreadCheckpoint(const std::string& checkpoint, bool fresh = false, int nproc = 1);

}  // namespace shardcast::bench
