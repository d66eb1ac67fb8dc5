// runtime/load: the call after fully_shard. Every rank of the communicator calls Load together.
//
//   1. rank 0 (every rank, for each-rank) opens the checkpoint and resolves its plan by key
//   2. rank 0 broadcasts the manifest; every rank checks it against its own plan
//   3. one verdict: all ranks go on, or all raise the same error -- no data moves before this
//   4. shard storage is allocated (only this rank's rows), then the stream runs
//   5. with verify, every rank's xxHash of every entry is compared with the sender's
//   6. per-rank reports are gathered to every rank
// A failure during the stream is published by the rank that saw it, and every other rank raises
// that same message instead of its own "connection closed".
//
// Failure: shardcast::Error of kind kManifestMismatch, kCheckpoint, kCommTimeout, kComm, ... with the
// same message on every rank.
#pragma once

#include <string>
#include <vector>

#include "allocators/memory_probe.h"
#include "runtime/communicator.h"
#include "runtime/load_options.h"
#include "runtime/manifest.h"
#include "runtime/materializer.h"
#include "runtime/stream.h"

namespace shardcast {

struct RankReport {
  int rank = 0;
  uint64_t bytes_received = 0, bytes_stored = 0, bytes_sent = 0, bytes_read = 0;
  double seconds = 0;
  uint64_t peak_rss_anon = 0, peak_rss_file = 0;  // above this rank's baseline at the start of Load
  uint64_t baseline_rss_anon = 0, baseline_rss_file = 0;
  int verified = -1;  // -1 not asked, 1 every entry matched
};

struct LoadReport {
  std::string source, target, backend;
  int world_size = 1;
  uint64_t entries = 0, total_bytes = 0, skipped_keys = 0;
  uint64_t chunk_bytes = 0;  // the options the load ran with
  int staging_slots = 0;
  std::vector<std::string> skipped_examples;
  double seconds = 0;  // this rank's wall time
  std::vector<RankReport> ranks;  // every rank's, gathered
  std::string ToJson() const;
};

struct LoadRequest {
  std::string checkpoint;
  LoadOptions options;
  KeyMapping mapping;
  ExtraKeys extra_keys = ExtraKeys::kSkip;
  bool checksum_only = false;  // default false. true: receive and hash, keep nothing (benchmarks)
  Progress progress;           // default none: called on rank 0 as bytes go out
};

// Every rank's report on every rank (one small all-reduce). `mine` is this rank's; rank ignored.
std::vector<RankReport> GatherReports(Communicator& comm, const RankReport& mine);

// REQUIRES: state prepared from a plan of comm.world_size() ranks, for comm.rank() (checked in the
// handshake). Allocates the state's shards unless checksum_only.
LoadReport Load(Communicator& comm, RankState* state, const LoadRequest& request);

// For a rank that could not even prepare (bad config, no memory): takes part in the handshake's
// collectives with its problem, so every rank raises the same error instead of waiting. Always throws.
[[noreturn]] void FailHandshake(Communicator& comm, ErrorKind kind, const std::string& problem);

}  // namespace shardcast
