// runtime/load_options: how a load runs. One plain struct; every field has a documented default, and
// SHARDCAST_* environment variables override them in one place (ApplyEnvironment).
#pragma once

#include <chrono>
#include <cstdint>
#include <string>

#include "runtime/materializer.h"

namespace shardcast {

enum class Source {
  kRank0,     // rank 0 reads and sends each rank only its rows (scatter); needs storage on rank 0 only
  kEachRank,  // every rank reads its own rows; for storage every rank can see; no data communication
};
const char* SourceName(Source source);

struct LoadOptions {
  Source source = Source::kRank0;                 // default kRank0
  Target target = Target::kCpu;                   // default kCpu
  uint64_t chunk_bytes = 64ull << 20;             // default 64 MiB: one staging slot       (SHARDCAST_CHUNK_BYTES)
  int staging_slots = 4;                          // default 4: slots in the staging ring    (SHARDCAST_STAGING_SLOTS)
  std::chrono::milliseconds timeout{10 * 60 * 1000};  // default 10 min per collective       (SHARDCAST_TIMEOUT_MS)
  bool verify = false;                            // default false: xxHash every entry on every rank
  bool release_pages = true;                      // default true: give consumed file pages back
  bool pread = false;                             // default false: read with pread instead of mmap (SHARDCAST_PREAD)

  uint64_t staging_bytes() const { return chunk_bytes * static_cast<uint64_t>(staging_slots); }
};

// Overrides fields from SHARDCAST_CHUNK_BYTES, SHARDCAST_STAGING_SLOTS, SHARDCAST_TIMEOUT_MS and
// SHARDCAST_PREAD where set. Throws kInvalidArgument naming the variable on a bad value. Callers with
// explicit arguments (CLI flags, Python keywords) apply the environment first and their arguments
// after, so an explicit argument wins, then call Validate.
void ApplyEnvironment(LoadOptions* options);

// Throws kInvalidArgument when the options cannot work (chunk < 4096, fewer than 2 staging slots).
void Validate(const LoadOptions& options);

}  // namespace shardcast
