// runtime/stream: moving the bytes the schedule names, after the handshake agreed.
//
// Source rank0: a reader thread copies each message's segments out of the mapping into the next free
// slot of a K-slot staging ring (converting dtype there), releases the file pages it consumed, and
// hands the slot to the sending thread, which sends it to its one destination (or broadcasts it).
// Reading message i+1 overlaps sending message i. Receivers take their messages in the same order,
// in place when a message is one segment, through a small bounce buffer when it is a coalesced pack.
//
// Source each-rank: every rank reads only its own messages from its own view of the files.
//
// Thread safety: internal. Failure: throws; the caller turns it into one agreed error.
#pragma once

#include <ATen/core/Tensor.h>

#include <atomic>
#include <functional>
#include <vector>

#include "loaders/checkpoint.h"
#include "runtime/communicator.h"
#include "runtime/load_options.h"
#include "runtime/manifest.h"

namespace shardcast {

// Where the bytes of manifest entry i land on this rank. An undefined tensor: hash only (the
// checksum-only sink of the full-scale benchmark).
struct StreamTargets {
  std::vector<at::Tensor> tensors;  // one per manifest entry; CPU, pinned or CUDA
};

struct StreamStats {
  uint64_t bytes_read = 0;      // from files (reader / each-rank)
  uint64_t bytes_sent = 0;      // on the wire, from this rank
  uint64_t bytes_received = 0;  // on the wire, to this rank
  uint64_t bytes_stored = 0;    // into this rank's tensors
  std::vector<uint64_t> digests;  // rank-0: entries x world expected; others: entries (this rank's)
};

// Progress callback on the sending rank: bytes done, bytes total.
using Progress = std::function<void(uint64_t done, uint64_t total)>;

StreamStats StreamRank0(Communicator& comm, const Manifest& m, const Checkpoint* ckpt, StreamTargets& targets,
                        const LoadOptions& options, const Progress& progress);
StreamStats StreamEachRank(Communicator& comm, const Manifest& m, const Checkpoint& ckpt, StreamTargets& targets,
                           const LoadOptions& options);

// Total bytes on the wire for a manifest (for progress and GB/s).
uint64_t TotalTargetBytes(const Manifest& m, int world_size);

}  // namespace shardcast
