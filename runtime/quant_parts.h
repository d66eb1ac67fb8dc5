// runtime/quant_parts: checkpoint parts stored in another layout than their entry's, resolved by rank
// 0 into the manifest and dequantized by the reader. Each format is an entry of the registry in
// loaders/quant/format.h (detect, shapes, bind, read, prefetch); this file only turns its answers into
// manifest parts and back. A part's Packing is its format's manifest id. The hooks the runtime calls:
//   Resolve (manifest.cc)    ResolveMxfp4Part, where the checkpoint has no tensor under the entry's key;
//                            ResolveNvfp4Part, where it holds a U8 tensor with NVFP4 scales beside it
//   FileSource (source.cc)   ReadPacked / PrefetchPacked for every part that dequantizes (fp8's
//                            block-scaled rows have Packing kNone; MXFP4 and NVFP4 their own)
//
// The global scale of an NVFP4 part is read by rank 0 at resolve time and travels in the manifest
// (ManifestScale::global_bits), so every rank applies the same one.
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

// Both resolvers return a part whose key and shape `manifest` keeps (Manifest::Keep, KeepShape).
//
// Rank 0: the part of entry `model_key` (shape, target dtype) when the checkpoint holds "<ck>_blocks";
// nullopt when it holds no such tensor. `ck` is the entry's checkpoint key. Throws kCheckpoint naming
// the key and every shape when "<ck>_scales" is missing or the pair does not make `shape`;
// kManifestMismatch for a U8 target (kept quantized) of another shape than the blocks' with their last
// two dims merged (the matching one is composed from "<ck>_blocks" directly, never reaching here);
// kUnsupported for other dtypes it cannot dequantize.
std::optional<ManifestPart> ResolveMxfp4Part(Manifest* manifest, const Checkpoint& ckpt, const FileIndex& files, const std::string& model_key,
                                             const std::string& ck, const std::vector<uint64_t>& shape, DType target);

// Rank 0: the part of a model entry `model_key` (target dtype) that the checkpoint holds as `found`
// (key `ck`), when `found` is a U8 "<m>.weight" with "<m>.weight_scale" or "<m>.weight_scale_2" beside
// it and `target` is floating; nullopt otherwise (a U8 entry loads the packed bytes as they are). The
// part's shape is [out, in] from the checkpoint; the caller checks it against the entry's. Throws
// kCheckpoint naming the key and the three tensors' dtypes and shapes when a scale is missing or the
// three do not pair (CheckNvfp4Triple); kUnsupported for a non-floating target.
std::optional<ManifestPart> ResolveNvfp4Part(Manifest* manifest, const Checkpoint& ckpt, const FileIndex& files, const std::string& model_key,
                                             const std::string& ck, const Checkpoint::Entry& found, DType target);

// The keys an NVFP4 part consumes beside its weight: its two scales, and "<m>.input_scale" when present.
std::vector<std::string> Nvfp4ConsumedKeys(const ManifestPart& p);

// The checkpoint bytes a packed part reads once (its format's source_bytes); by name for each format.
uint64_t PackedSourceBytes(const ManifestPart& p);
uint64_t Mxfp4SourceBytes(const ManifestPart& p);
uint64_t Nvfp4SourceBytes(const ManifestPart& p);

// Writes elements [first, first + count) of a part that dequantizes (the entry's order) as `target` at
// `out`, by its format's read. scratch holds one step of stored bytes and scales at a time (fp8 and
// NVFP4: at most 8 MiB of stored rows; MXFP4: one expert); `release` drops each step's file pages once
// read.
void ReadPacked(const ManifestPart& p, const FileTable& files, uint64_t first, uint64_t count, DType target,
                Buffer* scratch, bool release, unsigned char* out);

// Asks for the stored bytes that elements [first, first + count) of a part that dequantizes come from.
void PrefetchPacked(const ManifestPart& p, const FileTable& files, uint64_t first, uint64_t count);

}  // namespace shardcast
