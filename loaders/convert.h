// loaders/convert: a checkpoint rewritten with its block-quantized fp8 weights dequantized to BF16,
// F16 or F32 (the offline job DeepSeek's fp8_cast_bf16.py does), with bounded memory: every output
// tensor is produced in chunks from the mapped input and written as it goes, consumed input pages
// released. No GPU, no whole file in memory.
//
//   input:  model.layers.0.mlp.up_proj.weight            F8_E4M3 [out, in]
//           model.layers.0.mlp.up_proj.weight_scale_inv  F32 [ceil(out/128), ceil(in/128)]
//   output: model.layers.0.mlp.up_proj.weight            BF16 [out, in]       (the scale is gone)
// ModelOpt NVFP4 weights the same way (loaders/quant/nvfp4.h): "<m>.weight" U8 [out, in / 2] with its
// "<m>.weight_scale" and "<m>.weight_scale_2" becomes "<m>.weight" [out, in]; the scales and
// "<m>.input_scale" (an activation scale, meaningless to a dequantized model) are dropped.
// Every other tensor is copied byte for byte. Output tensors keep the input's order (file by file,
// each in data order) and are split into files of at most max_shard_bytes as Hugging Face does.
//
// Several processes can write one conversion: each writes the output files given to it
// (WriteConvertedFile), and one writes the index and config at the end.
//
// Thread safety: a ConvertPlan is immutable; distinct files may be written concurrently.
// Failure: kCheckpoint naming the key for an fp8 weight without a usable scale (never a raw cast);
// kIo naming the file for a write that fails (full disk: ENOSPC, EFBIG).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "loaders/checkpoint.h"
#include "loaders/quant/dequant.h"
#include "loaders/quant/format.h"
#include "loaders/writer.h"

namespace shardcast {

struct ConvertOptions {
  DType target = DType::kBF16;               // default BF16: what fp8 weights become (BF16, F16, F32)
  uint64_t max_shard_bytes = 5000000000ull;  // default 5 GB per output file (Hugging Face's default)
  uint64_t chunk_bytes = 64ull << 20;        // default 64 MiB: output produced at a time
  BlockSize block;                           // default 128 x 128: the input config's weight_block_size
};

struct ConvertPlan {
  struct Output {
    std::string key;                      // the model's key (MXFP4: "<p>" of "<p>_blocks")
    DType source_dtype;                   // in the input
    const QuantFormat* format = nullptr;  // the data's format, dequantized to `target`; nullptr: copied
    std::string source_key;               // the input's key of a dequantized output
  };
  std::vector<CheckpointFile> files;  // the output layout
  std::vector<Output> outputs;        // by key order within files: files[f].entries[i] <-> outputs[k]
  uint64_t dequantized = 0, copied = 0, dropped_scales = 0;
  uint64_t input_bytes = 0, output_bytes = 0;
};

// Decides the output: which tensors are dequantized (every data tensor a format of
// loaders/quant/format.h claims, checked by its bind), which scales are dropped, which tensors are
// copied, and the files. Throws as the header says.
ConvertPlan PlanConvert(const Checkpoint& input, const ConvertOptions& options);

// Writes output file `file` of the plan into `dir` (temp name, fsync, rename). Peak memory is about
// 2 x chunk_bytes plus one block row of scales.
void WriteConvertedFile(const Checkpoint& input, const ConvertPlan& plan, size_t file, const std::string& dir,
                        const ConvertOptions& options);

// The input's config.json text without quantization_config, with torch_dtype (and dtype) set to the
// target's name ("bfloat16", "float16", "float32").
std::string ConvertedConfig(const std::string& config_json, DType target);

}  // namespace shardcast
