// Real Gloo ranks on threads of one test binary (as gloo's and nccl-tests' own tests run them): every
// rank is a c10d ProcessGroupGloo over loopback TCP, with rendezvous through an in-process HashStore.
#pragma once

#include <chrono>
#include <functional>

#include "runtime/agree/communicator.h"

namespace shardcast::testing {

// Runs fn(comm) on `world` threads, one rank each; rethrows nothing (fn records its own results).
void RunThreadRanks(int world, const std::function<void(Communicator&)>& fn,
                    std::chrono::milliseconds timeout = std::chrono::milliseconds(20000));

}  // namespace shardcast::testing
