// runtime/agree/agreement: the one shape of a phase whose answer every rank must share.
//
//   1. gather  every rank's few facts (int64s, the same count on every rank)         all-gather
//   2. decide  the coordinator (rank 0), if it has no problem yet, turns the facts    rank 0 only
//              into a decision (bytes)
//   3. share   the decision: its size, then its bytes (none if rank 0 failed)         two broadcasts
//   4. check   every rank without a problem checks the decision against its own       every rank
//   5. agree   one verdict: every rank returns, or every rank raises the same error   all-reduce
//
// A rank that failed before the phase (no plan, no memory, a bad argument) enters the same function
// with its problem: it runs neither decide nor check, only the same collectives in the same order, so
// no rank waits for it and every rank raises the same error. The order of the collectives is written
// here and nowhere else: there is no failure twin to keep in step by hand.
//
// decide and check report a problem by throwing (shardcast::Error keeps its kind; anything else is
// kInternal). Thread safety: one thread per rank. Failure: the verdict's shardcast::Error, the same on
// every rank; kComm/kCommTimeout when a collective fails (wrap the call in Together to agree on those).
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "runtime/agree/communicator.h"
#include "runtime/agree/verdict.h"

namespace shardcast {

using Facts = std::vector<std::vector<int64_t>>;  // row r: rank r's facts

struct Deciding {
  const char* phase = "";           // names the verdict ("handshake", "save layout")
  std::vector<int64_t> facts;       // this rank's; empty on every rank: no gather
  std::function<std::string(const Facts&)> decide;                      // rank 0; never empty
  std::function<void(const std::string& decision, const Facts&)> check;  // every rank; throws a problem
};

// Runs steps 1-5. `local`: the problem this rank entered with (empty: none).
void DecideAndAgree(Communicator& comm, const Deciding& d, Problem local = {});

}  // namespace shardcast
