// runtime/agree/verdict: one answer for all ranks.
//
// Agree: every rank passes its local problem (empty if none). Either every rank returns, or every rank
// throws the same Error: the kind of the lowest failing rank, and a message listing each failing
// rank's problem in rank order. One small all-reduce carries it: each rank writes its message into its
// own slot of a zeroed buffer, and the sum gives every rank every slot.
//
// AllGather: the same slot trick for a few int64s per rank (reports, counters).
#pragma once

#include <string>
#include <vector>

#include "runtime/agree/communicator.h"

namespace shardcast {

inline constexpr size_t kVerdictSlotBytes = 1024;  // a longer message is cut, and says so

struct Problem {
  ErrorKind kind = ErrorKind::kManifestMismatch;
  std::string message;  // empty: no problem
};

void Agree(Communicator& comm, const std::string& phase, const Problem& local);

// values: this rank's n values. Returns world_size rows of n values, row r from rank r.
std::vector<std::vector<int64_t>> AllGather(Communicator& comm, const std::vector<int64_t>& values);

}  // namespace shardcast
