// runtime/engine/stream: moving the bytes the schedule names, after the handshake agreed, for any Route.
//
// One loop on every rank walks the agreed schedule. For each message the route says what this rank
// does (read it, keep it, send it, broadcast it, receive it, hash it for verify); reading happens
// ahead in the staging ring's thread, so reading message i+1 overlaps sending message i; bytes that
// stay on this rank go to its Sink. Receivers take messages in schedule order, in place when a message
// is one segment and the sink's memory is where the transport writes, through a bounce buffer when it
// is a coalesced pack.
//
// Thread safety: internal. Failure: throws; the caller turns it into one agreed error. A failure with sends
// in flight aborts the communicator, then releases those sends (the transport is done with their bytes)
// before the buffers they read from are freed. A receive's work is destroyed before Recv returns or throws.
// Known gap: a broadcast that timed out on a caller's Gloo group (not owned, so Abort does not join
// its worker threads) may still run on that group's worker until gloo's own timeout.
#pragma once

#include <functional>
#include <memory>

#include "runtime/agree/communicator.h"
#include "runtime/engine/sink.h"
#include "runtime/stream/digest.h"
#include "runtime/stream/progress.h"
#include "runtime/stream/route.h"
#include "runtime/stream/staging_ring.h"

namespace shardcast {

struct StreamStats {
  uint64_t bytes_read = 0;      // from files
  uint64_t read_threads = 0;    // the staging ring's reader threads (0: this rank read nothing)
  uint64_t pinned_staging = 0;  // bytes of page-locked staging (0: pageable, or none asked)
  double pin_seconds = 0;       // spent page-locking it (inside the stream's time)
  uint64_t bytes_sent = 0;      // on the wire, from this rank (a broadcast counts once per receiver)
  uint64_t bytes_received = 0;  // on the wire, to this rank
  uint64_t bytes_stored = 0;    // into this rank's sink
  uint64_t messages = 0;        // that this rank took part in
};

struct StreamContext {
  Communicator* comm = nullptr;
  const Manifest* manifest = nullptr;
  const Route* route = nullptr;
  // REQUIRES: set when the route has this rank read. Shared with the staging ring's reader, which may
  // outlive the stream inside a hung read (staging_ring.h).
  std::shared_ptr<SegmentSource> source;
  Sink* sink = nullptr;
  uint64_t readahead_bytes = 256ull << 20;
  uint32_t read_threads = 1;  // the staging ring's readers (staging_ring.h)
  bool pin_staging = false;   // page-lock the ring's slots (a CUDA target: each slot's copy to the device)
  Progress progress;
};

struct StreamResult {
  StreamStats stats;
  DigestColumn held;          // with verify: digests of what this rank stored, per entry
  ExpectedDigests expected;   // with verify: what this rank hashed as a verifier, per destination
  std::vector<int> verifiers;  // with verify: the ranks that hashed what this rank stored, ascending
};

// What this rank will do, from a walk of its part of the schedule alone (no I/O): its bytes and message count.
StreamStats PlanStream(const StreamContext& c);

StreamResult RunStream(const StreamContext& c);

// RunStream with one outcome on every rank: a failure on a route with data on the wire goes through the
// store (its peers are blocked on this rank: FailTogether), on one without by a verdict named
// `verdict_phase`. `operation` ("load", "save") names the operation in those errors; with `name_rank`
// the failing rank's message starts with "rank N: ".
StreamResult StreamTogether(Communicator& comm, const StreamContext& c, const char* operation,
                            const char* verdict_phase, bool name_rank);

// Total target bytes of a manifest (every entry once).
uint64_t TotalTargetBytes(const Manifest& m);

}  // namespace shardcast
