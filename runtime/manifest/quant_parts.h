// runtime/manifest/quant_parts: checkpoint parts stored in another layout than their entry's, resolved by
// rank 0 into the manifest. Each format is an entry of the registry in loaders/quant/format.h (detect,
// shapes, bind, read, prefetch); this file only turns its answers into manifest parts and back. A
// part's Packing is its format's manifest id (fp8's block-scaled rows: kNone, with dequantize). Called by
//   Resolve (manifest.cc)    ResolveFp8Part for an fp8 tensor of a floating entry; ResolveMxfp4Part where
//                            the checkpoint has no tensor under the entry's key; ResolveNvfp4Part where it
//                            holds a U8 tensor with NVFP4 scales beside it
//   FileSource (stream/)     FormatOf and PackedOf, to read and prefetch a part that dequantizes
//
// The global scale of an NVFP4 part is read by rank 0 at resolve time and travels in the manifest
// (ManifestScale::global_bits), so every rank applies the same one.
//
// Failure: kCheckpoint naming the key and shapes from the resolvers (their format's bind).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "loaders/checkpoint.h"
#include "loaders/quant/format.h"
#include "runtime/manifest/manifest.h"

namespace shardcast {

using FileIndex = std::unordered_map<const SafetensorsFile*, uint32_t>;

// Every resolver returns a part whose key and shape `manifest` keeps (Manifest::Keep, KeepShape); where
// the part's key equals `entry_key` (kept by the manifest already), the part views that one.

// Rank 0: the part of an fp8 tensor `ck` dequantized to the floating `target` with its block scales
// (block: the config's weight_block_size). Throws kCheckpoint naming the key when the scale is missing
// or does not fit the weight (kFp8Format's bind).
ManifestPart ResolveFp8Part(Manifest* manifest, const Checkpoint& ckpt, const FileIndex& files,
                            const std::string& model_key, std::string_view entry_key, const std::string& ck,
                            BlockSize block, DType target);

// Rank 0: the part of entry `model_key` (shape, target dtype) when the checkpoint holds "<ck>_blocks";
// nullopt when it holds no such tensor. `ck` is the entry's checkpoint key. Throws kCheckpoint naming
// the key and every shape when "<ck>_scales" is missing or the pair does not make `shape`;
// kManifestMismatch for a U8 target (kept quantized) of another shape than the blocks' with their last
// two dims merged (the matching one is composed from "<ck>_blocks" directly, never reaching here);
// kUnsupported for other dtypes it cannot dequantize.
std::optional<ManifestPart> ResolveMxfp4Part(Manifest* manifest, const Checkpoint& ckpt, const FileIndex& files,
                                             const std::string& model_key, const std::string& ck,
                                             const std::vector<uint64_t>& shape, DType target);

// Rank 0: the part of a model entry `model_key` (target dtype) that the checkpoint holds under `ck`,
// when that is a U8 "<m>.weight" with "<m>.weight_scale" or "<m>.weight_scale_2" beside it and `target`
// is floating; nullopt otherwise (a U8 entry loads the packed bytes as they are). The part's shape is
// [out, in] from the checkpoint; the caller checks it against the entry's. Throws kCheckpoint naming
// the key and the three tensors' dtypes and shapes when a scale is missing or the three do not pair
// (CheckNvfp4Triple); kUnsupported for a non-floating target.
std::optional<ManifestPart> ResolveNvfp4Part(Manifest* manifest, const Checkpoint& ckpt, const FileIndex& files,
                                             const std::string& model_key, const std::string& ck, DType target);

// The keys a part that dequantizes consumes beside its data: its scales (and NVFP4's "<m>.input_scale"
// when present), by its format's `consumed`.
std::vector<std::string> PackedConsumedKeys(const ManifestPart& p);

// The checkpoint bytes a part that dequantizes reads once (its format's source_bytes).
uint64_t PackedSourceBytes(const ManifestPart& p);

// The format of a part that dequantizes: its Packing is the format's manifest id. kInternal for a part
// that does not dequantize or a packing no format has.
const QuantFormat& FormatOf(const ManifestPart& p);

// The bound tensor of a part that dequantizes, its bytes in `files` (nullptr without them: sizes only).
PackedTensor PackedOf(const ManifestPart& p, const FileTable* files);

}  // namespace shardcast
