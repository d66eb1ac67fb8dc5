// runtime/quant_parts: checkpoint parts stored in another layout than their entry's, resolved by rank
// 0 into the manifest and dequantized by the reader. The two hooks the rest of the runtime calls:
//   Resolve (manifest.cc)    ResolveMxfp4Part, where the checkpoint has no tensor under the entry's key
//   FileSource (source.cc)   ReadMxfp4 / PrefetchMxfp4 for a part with Packing::kMxfp4
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
// kUnsupported for dtypes it cannot dequantize (a non-floating target included).
std::optional<ManifestPart> ResolveMxfp4Part(const Checkpoint& ckpt, const FileIndex& files, const std::string& model_key,
                                             const std::string& ck, const std::vector<uint64_t>& shape, DType target);

// The checkpoint bytes an MXFP4 part reads once: its blocks and its scales.
uint64_t Mxfp4SourceBytes(const ManifestPart& p);

// Writes elements [first, first + count) of an MXFP4 part (the entry's order) as `target` at `out`.
// scratch holds one expert's packed bytes at a time; `release` drops each expert's file pages once
// read.
void ReadMxfp4(const ManifestPart& p, const FileTable& files, uint64_t first, uint64_t count, DType target,
               Buffer* scratch, bool release, unsigned char* out);

// Asks for the packed bytes of the experts that elements [first, first + count) come from.
void PrefetchMxfp4(const ManifestPart& p, const FileTable& files, uint64_t first, uint64_t count);

}  // namespace shardcast
