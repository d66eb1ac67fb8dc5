// runtime/stream/progress: how a load or save reports its bytes as they move (part of the public API: load.h
// and save.h take one; the stream calls it).
#pragma once

#include <cstdint>
#include <functional>

namespace shardcast {

// Called on every rank as its messages complete: this rank's bytes done and its total.
using Progress = std::function<void(uint64_t done, uint64_t total)>;

}  // namespace shardcast
