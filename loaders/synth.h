// loaders/synth: deterministic synthetic checkpoints for a ModelSpec.
//
// Element i of tensor `key` is a pure function of (seed, key, i), so any rank can check any byte it
// received without the file. Values by dtype:
//   - F16, BF16, F32, F64: finite, non-zero and small, |x| in [2^-7, 1) (or the nearest the dtype has);
//   - F8_E4M3, F8_E5M2 (quantized weights): what block quantization produces, a bell-shaped spread
//     over the whole format scaled so its extremes are the largest finite value (448, 57344), rounded
//     to nearest even; zeros and subnormals occur rarely, NaN and inf never;
//   - scales, the entries whose key ends in "_scale_inv" (F32, BF16, F16 or F8_E8M0): positive,
//     log-uniform by binade in [2^-14, 2^-6), so every block of a weight has its own scale;
//   - F8_E8M0 elsewhere: 2^-7 .. 2^0; integers: uniform bits (NVFP4's packed weights: every E2M1 code);
//   - NVFP4 (ModelOpt): "<m>.weight_scale" F8_E4M3 every positive finite code 0x01..0x7E (2^-9 .. 448),
//     "<m>.weight_scale_2" and "<m>.input_scale" F32 as scales above.
// A bf16 twin (SynthOptions::bf16_twin) is the same model with its fp8 and NVFP4 weights already
// dequantized.
// Thread-safe: pure functions.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "loaders/quant/dequant.h"
#include "loaders/model_spec.h"
#include "loaders/writer.h"

namespace shardcast {

struct SynthOptions {
  uint64_t seed = 0;             // default 0
  uint64_t max_shard_bytes = 0;  // default 0: one file. Else split into files of at most this size.
  bool sparse = false;           // default false. true: full-size files whose data area is a hole
  // default false. true: write the bf16 twin of a block-quantized fp8 spec (MakeBf16Twin): every
  // fp8 weight with a scale sidecar is BF16 holding exactly SynthDequantizedElements of it, and the
  // sidecars are left out. Loading the fp8 checkpoint with dequantization to BF16 must give the
  // twin's bytes. A spec without fp8 weights is written as it is.
  bool bf16_twin = false;
};

// A block-quantized synthetic weight: its fp8 values are SynthElements(seed, key, weight_dtype, ...),
// its scales SynthElements(seed, ScaleKeyFor(key), scale_dtype, ...). weight_dtype U8 is an NVFP4
// weight "<m>.weight" (loaders/quant/nvfp4.h): packed U8 values, "<m>.weight_scale" F8_E4M3 block scales
// and the "<m>.weight_scale_2" global, block {1, 16}.
struct SynthQuantizedWeight {
  std::string key;
  DType weight_dtype = DType::kF8_E4M3;
  DType scale_dtype = DType::kF32;
  std::vector<uint64_t> shape;  // [rows, cols], dequantized (NVFP4: [out, in], twice the packed columns)
  BlockSize block;
};

// The bf16 twin of a spec: the layout a bf16 checkpoint of the same model has.
struct Bf16Twin {
  // Each fp8 weight with a "<key>_scale_inv" sidecar, and each NVFP4 weight with its scales, becomes
  // BF16 (NVFP4's [out, in]), the sidecars (NVFP4's input_scale too) are gone, and
  // config_json loses quantization_config, so that a config.json written from it builds this very
  // spec when its torch_dtype is bfloat16 (DeepSeek-V3's and MiniMax-M2's are).
  ModelSpec spec;
  std::vector<SynthQuantizedWeight> dequantized;  // the twin's BF16 weights that were fp8, in spec order
};
// The block size is the config's quantization_config.weight_block_size (default 128 x 128).
// Throws kConfig when a scale sidecar's shape is not the weight's scale grid in that block size.
Bf16Twin MakeBf16Twin(const ModelSpec& spec);

// The spec as a model that keeps its block-quantized fp8 weights in `target` (BF16, F16 or F32) has it:
// the twin's layout with those weights in `target`. What `load --dtype` and `plan --dtype` build.
ModelSpec DequantizedSpec(const ModelSpec& spec, DType target);

// Elements [first, first + n) of Dequantize(the weight's synthetic fp8 values, its synthetic scales)
// in `target`: what a dequantizing load of the synthetic fp8 checkpoint yields, and the twin's bytes.
void SynthDequantizedElements(uint64_t seed, const SynthQuantizedWeight& w, DType target, uint64_t first, uint64_t n,
                              void* out);

uint64_t SynthTensorSeed(uint64_t seed, std::string_view key);

// Writes elements [first, first + n) of `key` into out (no alignment needed).
void SynthElements(uint64_t seed, std::string_view key, DType dtype, uint64_t first, uint64_t n, void* out);

// Index of the first element of `data` (elements [first, first + n)) that differs from the synthetic
// values, or UINT64_MAX when all match.
uint64_t SynthFirstMismatch(uint64_t seed, std::string_view key, DType dtype, uint64_t first, uint64_t n,
                            const void* data);

// The spec's checkpoint entries: parameters, persistent buffers and sidecars, in spec order.
std::vector<WriteEntry> CheckpointEntries(const ModelSpec& spec);

// Writes the spec's checkpoint entries (or, with options.bf16_twin, its twin's) with synthetic values.
WrittenCheckpoint WriteSynthCheckpoint(const ModelSpec& spec, const std::string& dir, const SynthOptions& options);

}  // namespace shardcast
