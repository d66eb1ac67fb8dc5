// loaders/synth: deterministic synthetic checkpoints for a ModelSpec.
//
// Element i of tensor `key` is a pure function of (seed, key, i), so any rank can check any byte it
// received without the file. Floating values are finite, non-zero and small (|x| in [2^-7, 1) or
// the nearest the dtype has); integer values are uniform bits. Thread-safe: pure functions.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "loaders/model_spec.h"
#include "loaders/writer.h"

namespace shardcast {

struct SynthOptions {
  uint64_t seed = 0;             // default 0
  uint64_t max_shard_bytes = 0;  // default 0: one file. Else split into files of at most this size.
  bool sparse = false;           // default false. true: full-size files whose data area is a hole
};

uint64_t SynthTensorSeed(uint64_t seed, std::string_view key);

// Writes elements [first, first + n) of `key` into out (no alignment needed).
void SynthElements(uint64_t seed, std::string_view key, DType dtype, uint64_t first, uint64_t n, void* out);

// Index of the first element of `data` (elements [first, first + n)) that differs from the synthetic
// values, or UINT64_MAX when all match.
uint64_t SynthFirstMismatch(uint64_t seed, std::string_view key, DType dtype, uint64_t first, uint64_t n,
                            const void* data);

// The spec's checkpoint entries: parameters, persistent buffers and sidecars, in spec order.
std::vector<WriteEntry> CheckpointEntries(const ModelSpec& spec);

WrittenCheckpoint WriteSynthCheckpoint(const ModelSpec& spec, const std::string& dir, const SynthOptions& options);

}  // namespace shardcast
