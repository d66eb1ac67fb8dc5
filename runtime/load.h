// runtime/load: the call after fully_shard. Every rank of the communicator calls Load together.
//
//   1. handshake: rank 0 resolves its plan by key into the manifest (with the stream's parameters);
//      every rank checks it, the route's readers match the files; one verdict (handshake.h)
//   2. allocate: only this rank's rows; a rank that cannot is one agreed error (a second verdict)
//   3. stream: one loop for every route, bytes into this rank's sink (stream.h)
//   4. verify (optional): every rank's digests against its verifiers' (verify.h)
//   5. every rank's report, gathered to every rank
// A failure while data moves is published by the rank that saw it and every other rank raises that
// same message (failure.h); a route with no data on the wire (each-rank) agrees on failures by verdict.
//
// Failure: shardcast::Error of kind kManifestMismatch, kCheckpoint, kCommTimeout, kComm, kIo, ... with
// the same message on every rank.
#pragma once

#include <string>
#include <vector>

#include "allocators/memory_probe.h"
#include "runtime/agree/communicator.h"
#include "runtime/load_options.h"
#include "runtime/manifest/key_mapping.h"
#include "runtime/materialize/materializer.h"
#include "runtime/stream/progress.h"

namespace shardcast {

struct RankReport {
  int rank = 0;
  uint64_t bytes_received = 0, bytes_stored = 0, bytes_sent = 0, bytes_read = 0, messages = 0;
  uint64_t read_threads = 0, pinned_staging = 0;  // the stream's readers; its page-locked staging bytes
  uint64_t commit_threads = 0;  // threads that committed the host shards beside the stream (CommitBeside)
  uint64_t commit_threads_let_go = 0;  // of those, let go at the stream's end: their priority could not be lifted
  double seconds = 0;
  double handshake_seconds = 0, allocate_seconds = 0, stream_seconds = 0, verify_seconds = 0;
  double pin_seconds = 0;  // the part of stream_seconds spent page-locking the staging
  double cpu_seconds = 0;  // the process's CPU time (user + system, every thread) during the load
  double setup_cpu_seconds = 0;  // the part of cpu_seconds before the stream: handshake and allocation (the
                                 // shards' commit runs beside the stream: part of it may fall in here)
  uint64_t peak_rss_anon = 0, peak_rss_file = 0;  // above this rank's baseline at the start of Load
  uint64_t baseline_rss_anon = 0, baseline_rss_file = 0;
  int verified = -1;  // -1 not asked, 1 every entry matched
  uint64_t digest = 0;  // checksum-only: what this rank received, folded (ChecksumSink::digest); else 0
};

struct LoadReport {
  std::string source, target, backend, mesh;
  std::string source_reason;  // "asked for", or "auto: " and what rank 0 saw (handshake.h's ChooseSource)
  int world_size = 1, nodes = 1;
  uint64_t checkpoint_bytes = 0;  // what the entries read once from storage (sum of their parts)
  uint64_t entries = 0, total_bytes = 0, skipped_keys = 0;
  uint64_t dequantized = 0;  // entries whose fp8 checkpoint tensors were dequantized in the reader
  uint64_t chunk_bytes = 0;  // the agreed parameters the stream ran with
  int staging_slots = 0;
  bool setup_only = false;
  std::vector<std::string> skipped_examples;
  std::vector<std::string> adopted;  // this rank's options that rank 0's replaced
  double seconds = 0;                // this rank's wall time
  std::vector<RankReport> ranks;     // every rank's, gathered
  std::string ToJson() const;
};

struct LoadRequest {
  std::string checkpoint;
  LoadOptions options;         // from LoadOptionsBuilder
  KeyMapping mapping;
  bool checksum_only = false;  // default false. true: receive and hash, keep nothing (benchmarks)
  bool setup_only = false;     // default false. true: handshake, allocation and schedule; move no bytes
  Progress progress;           // default none: called on every rank as its messages complete
};

// Every rank's report on every rank (one small all-reduce). `mine` is this rank's; rank ignored.
std::vector<RankReport> GatherReports(Communicator& comm, const RankReport& mine);

// REQUIRES: state prepared from a plan of comm.world_size() ranks (its layouts: FSDP, HSDP, TP, ...),
// for comm.rank() (checked). Allocates the state's shards unless checksum_only.
LoadReport Load(Communicator& comm, RankState* state, const LoadRequest& request);

// For a rank that failed before it could call Load (its config, plan or state: bad input, no memory):
// call this where the other ranks call Load. It enters the handshake with the problem, so every rank
// raises the same error at once instead of waiting. Always throws. (Save's twin: FailSave.)
[[noreturn]] void FailLoad(Communicator& comm, ErrorKind kind, const std::string& problem);

}  // namespace shardcast
