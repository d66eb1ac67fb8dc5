// runtime/quant_parts: checkpoint parts stored in another layout than their entry's, resolved by rank
// 0 into the manifest and dequantized by the reader. The two hooks the rest of the runtime calls:
//   Resolve (manifest.cc)    ResolveMxfp4Part, where the checkpoint has no tensor under the entry's key;
//                            ResolveNvfp4Part, where it holds a U8 tensor with NVFP4 scales beside it
//   FileSource (source.cc)   ReadMxfp4 / PrefetchMxfp4 for a part with Packing::kMxfp4,
//                            ReadNvfp4 / PrefetchNvfp4 for one with Packing::kNvfp4
//
// MXFP4 (gpt-oss). A model entry "<key>" [E, in, out] is stored as "<key>_blocks" [E, out, in/32, 16]
// and "<key>_scales" [E, out, in/32] (loaders/mxfp4.h). The part carries the entry's own element
// order and shape, so the schedule cuts it on experts (dim-0 rows) like any other part. The reader
// produces elements [first, first + n) of the entry one expert at a time:
//
//   entry [E, in, out], elements [first, first + n)        expert e, stored [out, in/32, 16] + scales
//   e0: |......[=========|  <- tail rows of e0             read e's packed bytes (out x in / 2 + out x
//   e1: |================|  <- all of e1                   in / 32 bytes: a quarter of its bf16 size)
//   e2: |======].........|  <- head rows of e2             into scratch, then DequantizeMxfp4Transposed
//                                                          writes the window's rows straight into `out`
//
// So the reader's memory is one expert's packed bytes (8.3 MiB for gpt-oss-120b's gate_up_proj) on
// top of the staging ring; no rank, reader included, ever holds a dequantized expert or tensor.
// A window that starts or ends inside an expert reads that whole expert (the schedule's cuts fall
// on experts, so this happens only for messages larger than one expert's output, never in gpt-oss).
//
// NVFP4 (ModelOpt). A model entry "<m>.weight" [out, in] is stored as "<m>.weight" U8 [out, in / 2],
// "<m>.weight_scale" F8_E4M3 [out, in / 16] and "<m>.weight_scale_2" F32 (loaders/nvfp4.h). No
// transpose: the part's rows are the entry's rows, so the reader reads exactly the packed bytes and
// scales of the rows (or, for a cut row, of the 16-value blocks) it is asked for, nothing more:
//
//   elements [first, first + n) of [out, in]       packed rows: in / 2 bytes, scale rows: in / 16
//   r0: |.......[====|  <- a cut row: its blocks   [c0 / 16, ceil(c1 / 16)) alone, 8 bytes + 1 scale each
//   r1: |============|  <- whole rows, up to
//   r2: |============|     kNvfp4StepBytes packed bytes a read, dequantized straight into `out`
//   r3: |====].......|  <- a cut row
//
// The global scale (4 bytes) is read by rank 0 at resolve time and travels in the manifest
// (ManifestScale::global_bits), so every rank applies the same one. "<m>.input_scale" (the
// activations' scale, meaningful only to an NVFP4 matmul) is consumed with the weight and dropped.
//
// Thread safety: as FileSource (the reader thread only). Failure: kCheckpoint naming the key and
// shapes from Resolve; from the reader, what SafetensorsFile::ReadBytes throws.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "loaders/checkpoint.h"
#include "runtime/manifest.h"
#include "runtime/source.h"

namespace shardcast {

using FileIndex = std::unordered_map<const SafetensorsFile*, uint32_t>;

// Rank 0: the part of entry `model_key` (shape, target dtype) when the checkpoint holds "<ck>_blocks";
// nullopt when it holds no such tensor. `ck` is the entry's checkpoint key. Throws kCheckpoint naming
// the key and every shape when "<ck>_scales" is missing or the pair does not make `shape`;
// kManifestMismatch for a U8 target (kept quantized) of another shape than the blocks' with their last
// two dims merged (the matching one is composed from "<ck>_blocks" directly, never reaching here);
// kUnsupported for other dtypes it cannot dequantize.
std::optional<ManifestPart> ResolveMxfp4Part(const Checkpoint& ckpt, const FileIndex& files, const std::string& model_key,
                                             const std::string& ck, const std::vector<uint64_t>& shape, DType target);

// The checkpoint bytes an MXFP4 part reads once: its blocks and its scales.
uint64_t Mxfp4SourceBytes(const ManifestPart& p);

// Rank 0: the part of a model entry `model_key` (target dtype) that the checkpoint holds as `found`
// (key `ck`), when `found` is a U8 "<m>.weight" with "<m>.weight_scale" or "<m>.weight_scale_2" beside
// it and `target` is floating; nullopt otherwise (a U8 entry loads the packed bytes as they are). The
// part's shape is [out, in] from the checkpoint; the caller checks it against the entry's. Throws
// kCheckpoint naming the key and the three tensors' dtypes and shapes when a scale is missing or the
// three do not pair (CheckNvfp4Triple); kUnsupported for a non-floating target.
std::optional<ManifestPart> ResolveNvfp4Part(const Checkpoint& ckpt, const FileIndex& files, const std::string& model_key,
                                             const std::string& ck, const Checkpoint::Entry& found, DType target);

// The keys an NVFP4 part consumes beside its weight: its two scales, and "<m>.input_scale" when present.
std::vector<std::string> Nvfp4ConsumedKeys(const ManifestPart& p);

// The checkpoint bytes an NVFP4 part reads once: its packed values and its block scales.
uint64_t Nvfp4SourceBytes(const ManifestPart& p);

// Writes elements [first, first + count) of an NVFP4 part (row-major [out, in]) as `target` at `out`.
// scratch holds at most kNvfp4StepBytes of packed bytes and their scales; `release` drops the file
// pages of each step once read.
void ReadNvfp4(const ManifestPart& p, const FileTable& files, uint64_t first, uint64_t count, DType target,
               Buffer* scratch, bool release, unsigned char* out);

// Asks for the packed bytes and scales of the rows that elements [first, first + count) come from.
void PrefetchNvfp4(const ManifestPart& p, const FileTable& files, uint64_t first, uint64_t count);

// Writes elements [first, first + count) of an MXFP4 part (the entry's order) as `target` at `out`.
// scratch holds one expert's packed bytes at a time; `release` drops each expert's file pages once
// read.
void ReadMxfp4(const ManifestPart& p, const FileTable& files, uint64_t first, uint64_t count, DType target,
               Buffer* scratch, bool release, unsigned char* out);

// Asks for the packed bytes of the experts that elements [first, first + count) come from.
void PrefetchMxfp4(const ManifestPart& p, const FileTable& files, uint64_t first, uint64_t count);

}  // namespace shardcast
