// runtime/handshake: agreement before any data moves.
//
//   0. every rank says which node it is on and whether it sees the checkpoint (one small all-gather)
//   1. rank 0 opens the checkpoint and resolves its plan by key into the manifest, with its own
//      options as the stream's parameters (chunk, coalescing, staging, source, verify, strict keys);
//      source=auto is decided here (ChooseSource), and the manifest carries the choice and why
//   2. rank 0 broadcasts the manifest (as nothing, if it failed, so every rank runs the same steps)
//   3. every rank checks it against its own plan and options; a rank the route has read opens the
//      manifest's files itself (Checkpoint::OpenKnown: no index, no header parsed again) and matches
//      every file by name, size, header digest and a digest of samples of its data (its first, middle
//      and last 4 KiB: another checkpoint with the same tensors differs there)
//   4. one verdict: every rank goes on, or every rank raises the same error naming key, file, rank
//
// Thread safety: one thread per rank. Failure: shardcast::Error from the verdict, the same on every
// rank; kComm/kCommTimeout when a collective fails (the caller makes those agree too).
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "runtime/agree/communicator.h"
#include "runtime/agree/verdict.h"
#include "runtime/layout/mesh.h"
#include "runtime/manifest/manifest.h"
#include "runtime/stream/source.h"

namespace shardcast {

struct HandshakeRequest {
  std::string checkpoint;
  LoadOptions options;  // this rank's; rank 0's become the stream's parameters
  KeyMapping mapping;
};

struct Agreement {
  Manifest manifest;
  NodeMap nodes;                     // every rank's node, gathered
  std::unique_ptr<Checkpoint> ckpt;  // this rank's view, when the route has it read
  FileTable files;                   // by manifest file index, into ckpt
  std::vector<std::string> adopted;  // the reader's values this rank took over its own
};

// `failed`: the problem this rank enters with (runtime/agree/agreement.h); it then only takes part.
Agreement Handshake(Communicator& comm, const Plan& plan, const HandshakeRequest& request, Problem failed = {});

// source=auto: rank 0's choice from what every rank saw before the handshake (probes[r]: rank r's
// ProbeCheckpoint) and the plan's copies (ShardCopies):
//   every rank sees rank 0's checkpoint    one node: each-rank (each reads its own bytes, nothing sent)
//                                          several, FSDP: node-leader (one reader per node)
//                                          several, HSDP (>= 1.5 copies): striped (each shard read once)
//   every node's first rank sees it        node-leader
//   otherwise                              rank0 (the reason names the ranks that do not see it)
// A rank whose probe is another size sees a checkpoint, as one of the same size does: it reads its own,
// and the files' match in the handshake (MatchFiles: sizes, headers, data samples) refuses one that is
// not rank 0's (source=rank0, asked for, serves rank 0's to every rank).
struct SourceChoice {
  Source source = Source::kRank0;
  std::string reason;
};
SourceChoice ChooseSource(const std::vector<int64_t>& probes, const NodeMap& nodes, double copies);
// How many ranks hold each element of the sharded entries, weighted by bytes: 1 for FSDP and TP, R for
// HSDP's R replicas. 1 when nothing is sharded.
double ShardCopies(const Plan& plan);

// For a rank that could not even prepare (bad config, no memory): enters Handshake with its problem
// (no plan, no checkpoint), so every rank raises the same error instead of waiting. Always throws.
[[noreturn]] void FailHandshake(Communicator& comm, ErrorKind kind, const std::string& problem);

}  // namespace shardcast
