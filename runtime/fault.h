// runtime/fault: named points where a test makes this process fail on purpose, the way an operator's
// bad day goes (a rank killed, frozen or terminated; an allocation refused), so that every failure
// path is exercised by real processes.
//
//   SHARDCAST_FAULT="RANK:POINT:ACTION[:N]"   at the N-th time (default 1) rank RANK passes POINT
//
// Points: handshake (before the manifest broadcast), allocate (before shard storage), stream (each
// message this rank takes part in), verify (before the digest exchange), save-write, save-commit.
// Actions: kill (SIGKILL), stop (SIGSTOP), term (SIGTERM), exit (exit code 3 without cleanup),
// enomem (throw the error a refused allocation throws). Unset: every point is one branch on a cached
// flag. Thread safety: safe from any thread.
#pragma once

namespace shardcast {

void FaultPoint(const char* point, int rank);

}  // namespace shardcast
