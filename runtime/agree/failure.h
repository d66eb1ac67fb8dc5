// runtime/agree/failure: one error on every rank when a phase with data in flight fails.
//
// The rank that knows the cause publishes it through the store's side channel (rank 0 at once: it
// drives the stream and knows which peer died or which file broke); a rank whose collective merely
// failed waits briefly for what was published and raises that, publishing its own cause only when
// nothing comes, and then raising whichever failure stands (the first published). The communicator
// is aborted so peers blocked on this rank fail fast. A store that is frozen or gone yields the same
// note on every rank ("rank 0 (the store host ...) did not answer" / "is lost"). Nothing here waits
// without a deadline.
#pragma once

#include <chrono>
#include <exception>

#include "allocators/error.h"
#include "runtime/agree/communicator.h"
#include "runtime/agree/verdict.h"

namespace shardcast {

// How long a rank whose collective failed waits for a published cause, and rank 0 for the others to take it.
inline constexpr std::chrono::milliseconds kFailureFetchWait{3000};
inline constexpr std::chrono::milliseconds kFailureAckWait{3000};

// Always throws shardcast::Error, context "load" (or `phase`), with the agreed kind and message.
[[noreturn]] void FailTogether(Communicator& comm, const std::exception& e, const char* phase = "load");

// Whether an exception is a communication failure (kComm / kCommTimeout).
bool IsCommFailure(const std::exception& e);

// An exception as a verdict's problem: its kind and message (kInternal for one not shardcast's).
Problem AsProblem(const std::exception& e);

// Runs a step whose collectives may fail: a communication failure becomes the one agreed error
// (context `phase`); anything else (an agreed verdict) passes through unchanged.
template <typename F>
auto Together(Communicator& comm, F&& step, const char* phase = "load") -> decltype(step()) {
  try {
    return step();
  } catch (const Error& e) {
    if (IsCommFailure(e)) FailTogether(comm, e, phase);
    throw;
  }
}

}  // namespace shardcast
