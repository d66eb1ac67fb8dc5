// runtime/agree/fault: named points where a test makes this process fail on purpose, the way an operator's
// bad day goes (a rank killed, frozen or terminated; an allocation refused), so that every failure
// path is exercised by real processes.
//
//   SHARDCAST_FAULT="RANK:POINT:ACTION[:N]"   at the N-th time (default 1) rank RANK passes POINT
//   SHARDCAST_TEST_FAULTS=1                   required: without it a fault is never injected
//
// Points: make (the store reached, before this rank makes its Gloo group), group (this rank's Gloo group
// made, before the barrier that readies it on every rank),
// handshake (before the manifest broadcast), allocate (before shard storage), stream (each
// message this rank takes part in), verify (before the digest exchange), save-write, save-commit,
// metadata (rank 0, before it reads the checkpoint's headers for shardcast.dcp's read_metadata).
// Actions: kill (SIGKILL), stop (SIGSTOP), term (SIGTERM), exit (exit code 3 without cleanup),
// enomem (throw the error a refused allocation throws).
//
// Fault injection only ever acts in a test: SHARDCAST_FAULT alone (left in a production job's
// environment) is ignored, with one line on stderr saying so. With the switch set, a malformed value is
// kInvalidArgument naming it, from CheckFaultEnvironment (which option parsing calls) and from every
// FaultPoint. Unset: every point is one branch on a cached flag. Thread safety: safe from any thread.
#pragma once

#include <string>

namespace shardcast {

inline constexpr const char* kFaultVariable = "SHARDCAST_FAULT";
inline constexpr const char* kTestFaultsVariable = "SHARDCAST_TEST_FAULTS";

struct FaultSpec {
  bool armed = false;  // false: no fault (unset, or not a test)
  bool ignored = false;  // set, but the test switch is not: never acts
  int rank = -1;
  std::string point, action;
  long nth = 1;
};

// What `value` (SHARDCAST_FAULT's) asks for, given `test_switch` (SHARDCAST_TEST_FAULTS's; either may be
// null). Throws kInvalidArgument naming the value when the switch is "1" and the value is malformed: not
// RANK:POINT:ACTION[:N], a rank or N that is not a number, an unknown point or action.
FaultSpec ParseFaultSpec(const char* value, const char* test_switch);

// Parses the environment once (cached) and throws what ParseFaultSpec threw, every time it is called.
void CheckFaultEnvironment();

void FaultPoint(const char* point, int rank);

}  // namespace shardcast
