// loaders/quant/format: the registry of quantized checkpoint formats. A format is one entry, in its
// own file (loaders/quant/<name>_format.cc), and it answers everything the rest of shardcast asks of it:
//
//   detect       does this key, with its partners in the checkpoint, belong to me, and as which piece
//   stored_key   the key the data is stored under, for a model key the checkpoint lacks
//   model_shape  the shape of the dequantized tensor the model sees, from the stored data's shape
//   kept_shape   the shape a model that keeps the format quantized holds the data in (the same bytes)
//   consumed     the keys a read takes with the data (its scales, and sidecars dropped with it)
//   bind         the stored bytes a read needs (data, scales, global scale), checked: a PackedTensor
//   source_bytes the checkpoint bytes a read of the whole tensor touches
//   read         elements [first, first + count) of the model's tensor, dequantized by the kernel
//   prefetch     asks for the stored ranges a read of those elements touches
//
// Who asks: QuantOf (inspect, the fuzzer), runtime/manifest/quant_parts (rank 0's resolve), the file
// source's reads (runtime/stream/source.cc), convert, synth's bf16 twin, and the binding's
// quantization_of (so Python keeps no copy of the detection rules). The kernels stay in their own files (dequant, mxfp4, nvfp4) behind one ISA dispatch
// (dequant_internal::BestIsa). Adding a format is one entry file, its kernel, and one line in
// QuantFormats().
//
// Detect is the reader's claim: a key is a format's data when a read would take it as such, even if a
// partner is missing or does not pair (bind then names what is wrong, never a raw cast):
//
//   fp8     data  "<w>"          F8_*                 scale "<w>_scale_inv"
//   mxfp4   data  "<p>_blocks"   (model key "<p>")     scale "<p>_scales"
//   nvfp4   data  "<m>.weight"   U8, beside "<m>.weight_scale" or "<m>.weight_scale_2"
//                                                     scales both of those; sidecar "<m>.input_scale"
//
// Thread safety: the registry is built on first use and immutable after; entries are pure functions
// of their arguments (read and prefetch: as thread-safe as the files they are given).
// Failure: bind throws kCheckpoint naming the context, the keys, dtypes and shapes when the pieces do
// not pair; kUnsupported for a target the kernel cannot produce. read throws what
// SafetensorsFile::ReadBytes throws.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "loaders/checkpoint.h"
#include "loaders/dtype.h"
#include "loaders/quant/dequant.h"

namespace shardcast {

enum class QuantPiece : uint8_t {
  kNone,     // not one of a format's tensors
  kData,     // the packed values a read dequantizes
  kScale,    // read beside the data
  kSidecar,  // consumed with the data and dropped, never read (NVFP4's input_scale)
};

// A tensor as detect sees it: in a checkpoint, or in a spec about to be written.
struct StoredTensor {
  DType dtype = DType::kU8;
  const std::vector<uint64_t>* shape = nullptr;
};
// Looks a key up; nullopt when there is no such tensor.
using FindStored = std::function<std::optional<StoredTensor>(const std::string& key)>;
// The tensors of `ckpt`, which must outlive the result.
FindStored FindIn(const Checkpoint& ckpt);

struct QuantFormat;

struct QuantMatch {
  const QuantFormat* format = nullptr;  // nullptr: QuantPiece::kNone
  QuantPiece piece = QuantPiece::kNone;
  std::string data_key;   // the data's key (the key itself for kData)
  std::string model_key;  // the key the model holds the dequantized tensor under
  std::string partner;    // kData: its (first) scale's key, present or not; otherwise data_key
  // Whether every partner is there with the dtypes the format pairs by (what inspect names). A claim
  // that is not complete still belongs to its format: a read of it fails in bind, naming the problem.
  bool complete = false;
};

// The stored bytes of one quantized tensor, for read and prefetch. Offsets are absolute in their file.
struct PackedTensor {
  std::string data_key;
  DType data_dtype = DType::kU8;
  const SafetensorsFile* data_file = nullptr;
  uint64_t data_offset = 0;
  std::vector<uint64_t> shape;  // the model's (what elements index, row-major)
  std::string scale_key;
  DType scale_dtype = DType::kU8;
  const SafetensorsFile* scale_file = nullptr;
  uint64_t scale_offset = 0;
  uint64_t grid_rows = 0, grid_cols = 0;  // the scales' [rows, cols]
  BlockSize block;                        // data elements per scale
  uint32_t global_bits = 0;               // NVFP4: the F32 bits of "<m>.weight_scale_2"
};

// What bind checks the pieces against.
struct BindRequest {
  std::string context;                                // the error's context, e.g. "key 'model.x.weight'"
  DType target = DType::kBF16;                        // the dtype the model wants
  BlockSize block;                                    // fp8: the config's weight_block_size
  const std::vector<uint64_t>* model_shape = nullptr;  // default: the format's model_shape of the data
};

// A scratch buffer the reader owns: Get(n) returns at least n bytes, valid until the next Get.
using ScratchFn = std::function<unsigned char*(uint64_t bytes)>;

// Elements [first, first + count) of a PackedTensor's model tensor, as `target`, at `out`.
struct ReadRequest {
  uint64_t first = 0, count = 0;
  DType target = DType::kBF16;
  bool release = false;  // drop each step's file pages once read
};

// An entry, initialized in this field order by its file's one aggregate.
struct QuantFormat {
  std::string_view name;        // "fp8", "mxfp4", "nvfp4"
  uint8_t packing = 0;          // its layout id in the manifest (runtime/manifest/manifest.h Packing)
  std::string_view data_name;   // as inspect names the data ("mxfp4") and the scales ("mxfp4 scales")
  std::string_view scale_name;
  QuantMatch (*detect)(const FindStored& find, const std::string& key) = nullptr;
  // The data key that holds model key `model_key` when the format stores it under another key
  // (MXFP4: "<p>_blocks" for "<p>"); "" when the format keeps the model's key.
  std::string (*stored_key)(const std::string& model_key) = nullptr;
  std::vector<uint64_t> (*model_shape)(const std::vector<uint64_t>& stored) = nullptr;  // {}: none
  std::vector<uint64_t> (*kept_shape)(const std::vector<uint64_t>& stored) = nullptr;
  std::vector<std::string> (*consumed)(const std::string& data_key) = nullptr;
  // Whether a read to `target` dequantizes this data (otherwise the stored bytes load as they are).
  bool (*dequantizes_to)(DType target) = nullptr;
  // The data's stored bytes in `ckpt`, checked; throws as the header says.
  PackedTensor (*bind)(const Checkpoint& ckpt, const std::string& data_key, const BindRequest& request) = nullptr;
  uint64_t (*source_bytes)(const PackedTensor& t) = nullptr;
  void (*read)(const PackedTensor& t, const ReadRequest& request, const ScratchFn& scratch,
               unsigned char* out) = nullptr;
  void (*prefetch)(const PackedTensor& t, uint64_t first, uint64_t count) = nullptr;
};

// The entries, one a file (loaders/quant/<name>_format.cc).
extern const QuantFormat kFp8Format;
extern const QuantFormat kMxfp4Format;
extern const QuantFormat kNvfp4Format;

// Every format shardcast reads, in the order detect asks them (fp8, mxfp4, nvfp4).
const std::vector<const QuantFormat*>& QuantFormats();

// The format `key` belongs to: the first complete match, else the first claim; piece kNone when no
// format claims it or there is no such key.
QuantMatch DetectQuant(const FindStored& find, const std::string& key);

// By name or manifest packing id (0, the plain layout, is fp8's when a part dequantizes); nullptr when
// none has it.
const QuantFormat* QuantFormatNamed(std::string_view name);
const QuantFormat* QuantFormatOfPacking(uint8_t packing);

}  // namespace shardcast
