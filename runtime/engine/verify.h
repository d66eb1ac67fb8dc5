// runtime/engine/verify: after a stream with verify, every rank compares the digests of what it stored with
// what its verifiers hashed (the reader for rank0; for each-rank, the next rank, reading the same bytes
// from its own view of the files). Each verifier sends each rank it verified one column of per-entry
// digests (point to point, all sends posted before any receive), and one verdict follows.
//
// Failure: kComm naming the key, the rank and both digests, the same on every rank; kCheckpoint for
// each-rank, whose ranks read their own copies (a mismatch there means the copies differ).
#pragma once

#include "runtime/engine/stream.h"

namespace shardcast {

void VerifyDigests(Communicator& comm, const Manifest& m, const StreamResult& r);

}  // namespace shardcast
