// The NVFP4 entry (NVIDIA ModelOpt): "<m>.weight" U8 [out, in / 2], "<m>.weight_scale" F8_E4M3
// [out, in / 16] and "<m>.weight_scale_2" F32 hold the model's "<m>.weight" [out, in]
// (loaders/quant/nvfp4.h has the rule and the kernel). "<m>.input_scale" (the activations' scale, meaningful
// only to an NVFP4 matmul) is consumed with the weight and dropped.
//
// No transpose: the model's rows are the stored rows, so a read takes exactly the packed bytes and
// scales of the rows (or, for a cut row, of the 16-value blocks) it is asked for, nothing more:
//
//   elements [first, first + n) of [out, in]       packed rows: in / 2 bytes, scale rows: in / 16
//   r0: |.......[====|  <- a cut row: its blocks   [c0 / 16, ceil(c1 / 16)) alone, 8 bytes + 1 scale each
//   r1: |============|  <- whole rows, up to
//   r2: |============|     kStepBytes packed bytes a read, dequantized straight into `out`
//   r3: |====].......|  <- a cut row
//
// The global scale (4 bytes) is read once, by bind, so every reader of a manifest applies the same one.
#include <algorithm>
#include <cstring>

#include "allocators/error.h"
#include "loaders/quant/entry_util.h"
#include "loaders/quant/nvfp4.h"

namespace shardcast {
namespace {
using namespace quant_internal;

constexpr std::string_view kWeight = ".weight", kScale = ".weight_scale", kGlobal = ".weight_scale_2";
constexpr std::string_view kInput = ".input_scale";
constexpr uint64_t kStepBytes = 8ull << 20;  // packed bytes read, dequantized and released at a time

// A U8 "<m>.weight" with either scale beside it is NVFP4's; complete with an F8_E4M3 block scale.
QuantMatch DetectWeight(const FindStored& find, const std::string& key) {
  if (!EndsWith(key, kWeight) || find(key)->dtype != DType::kU8) return {};
  const std::string base = Strip(key, kWeight);
  const std::optional<StoredTensor> scale = find(base + std::string(kScale));
  if (!scale && !find(base + std::string(kGlobal))) return {};
  const bool complete = scale && scale->dtype == DType::kF8_E4M3;
  return Match(kNvfp4Format, QuantPiece::kData, key, key, base + std::string(kScale), complete);
}

QuantMatch Detect(const FindStored& find, const std::string& key) {
  for (std::string_view suffix : {kGlobal, kScale, kInput}) {
    if (!EndsWith(key, suffix)) continue;
    const std::string weight = Strip(key, suffix) + std::string(kWeight);
    if (suffix == kInput) {  // a sidecar of a weight this format claims
      if (!find(weight) || DetectWeight(find, weight).piece == QuantPiece::kNone) return {};
      return Match(kNvfp4Format, QuantPiece::kSidecar, weight, weight, weight, false);
    }
    if (auto w = find(weight); w && w->dtype == DType::kU8) {
      return Match(kNvfp4Format, QuantPiece::kScale, weight, weight, weight, true);
    }
  }
  return DetectWeight(find, key);
}

std::vector<uint64_t> ModelShape(const std::vector<uint64_t>& s) {
  if (s.size() != 2) return {};
  return {s[0], s[1] * 2};
}

// In this order: the block scales, the global scale, the input scale (synth's twin relies on it).
std::vector<std::string> Consumed(const std::string& weight_key) {
  const std::string base = Strip(weight_key, kWeight);
  return {base + std::string(kScale), base + std::string(kGlobal), base + std::string(kInput)};
}

// A non-floating entry loads the packed bytes as they are.
bool DequantizesTo(DType target) { return IsFloatingPoint(target); }

PackedTensor Bind(const Checkpoint& ckpt, const std::string& key, const BindRequest& r) {
  const std::string base = Strip(key, kWeight);
  const std::string scale_key = base + std::string(kScale), global_key = base + std::string(kGlobal);
  const Checkpoint::Entry& w = ckpt.Get(key);
  const Checkpoint::Entry* scale = ckpt.Find(scale_key);
  const Checkpoint::Entry* global = ckpt.Find(global_key);
  if (scale == nullptr || global == nullptr) {
    const Checkpoint::Entry& has = scale ? *scale : *global;
    throw Error(ErrorKind::kCheckpoint, r.context,
                TensorText(w, key) + " in " + w.file->path() + " has " +
                    TensorText(has, scale ? scale_key : global_key) + " but no '" + (scale ? global_key : scale_key) +
                    "' (an NVFP4 weight is never read without its block scales and its global scale)");
  }
  if (r.target != DType::kBF16 && r.target != DType::kF16 && r.target != DType::kF32) {
    throw Error(ErrorKind::kUnsupported, r.context,
                "NVFP4 weight '" + key + "' cannot be dequantized to " + std::string(DTypeName(r.target)) +
                    " (targets: BF16, F16 or F32)");
  }
  CheckNvfp4Triple(key, w.info->dtype, w.info->shape, scale->info->dtype, scale->info->shape, global->info->dtype,
                   global->info->shape);
  const uint64_t out = w.info->shape[0], in = w.info->shape[1] * 2;
  PackedTensor t;
  t.data_key = key;
  t.data_dtype = DType::kU8;
  t.data_file = w.file;
  t.data_offset = DataOffset(w);
  t.shape = {out, in};
  t.scale_key = scale_key;
  t.scale_dtype = scale->info->dtype;
  t.scale_file = scale->file;
  t.scale_offset = DataOffset(*scale);
  t.grid_rows = out;
  t.grid_cols = in / kNvfp4Block;
  t.block = BlockSize{1, kNvfp4Block};
  global->file->ReadBytes(DataOffset(*global), 4, &t.global_bits, "tensor '" + global_key + "'");
  return t;
}

uint64_t SourceBytes(const PackedTensor& t) {
  const uint64_t n = Numel(t.shape);
  return n / 2 + n / kNvfp4Block;
}

void Read(const PackedTensor& t, const ReadRequest& r, const ScratchFn& scratch, unsigned char* out) {
  const uint64_t cols = t.shape[1];
  if (r.count == 0 || cols == 0) return;
  float global;
  std::memcpy(&global, &t.global_bits, 4);
  const uint64_t row_bytes = cols / 2, row_scales = cols / kNvfp4Block, ts = DTypeSize(r.target);
  const uint64_t step_rows = std::max<uint64_t>(1, kStepBytes / row_bytes);
  for (uint64_t at = r.first, end = r.first + r.count; at < end;) {
    // Whole rows from row (up to step_rows), or the 16-value blocks [b0, b1) of one cut row.
    const uint64_t row = at / cols, c0 = at % cols;
    const bool whole = c0 == 0 && end - at >= cols;
    const uint64_t rows = whole ? std::min(step_rows, (end - at) / cols) : 1;
    const uint64_t c1 = whole ? cols : std::min(cols, c0 + (end - at));
    const uint64_t b0 = c0 / kNvfp4Block, b1 = (c1 + kNvfp4Block - 1) / kNvfp4Block;
    const uint64_t v_bytes = rows * (b1 - b0) * kNvfp4Block / 2, s_bytes = rows * (b1 - b0);
    const uint64_t v_at = t.data_offset + row * row_bytes + b0 * kNvfp4Block / 2;
    const uint64_t s_at = t.scale_offset + row * row_scales + b0;
    unsigned char* raw = scratch(v_bytes + s_bytes);
    t.data_file->ReadBytes(v_at, v_bytes, raw, "tensor '" + t.data_key + "'");
    t.scale_file->ReadBytes(s_at, s_bytes, raw + v_bytes, "tensor '" + t.scale_key + "'");
    const Nvfp4Matrix m{raw, raw + v_bytes, global, row, (b1 - b0) * kNvfp4Block};
    const uint64_t w0 = b0 * kNvfp4Block;
    DequantizeNvfp4(m, OutputWindow{{row, row + rows}, {c0 - w0, c1 - w0}}, r.target,
                    WindowOut{out + (at - r.first) * ts});
    if (r.release) {
      t.data_file->ReleasePages(v_at, v_bytes);
      t.scale_file->ReleasePages(s_at, s_bytes);
    }
    at += rows * (c1 - c0);
  }
}

void Prefetch(const PackedTensor& t, uint64_t first, uint64_t count) {
  const uint64_t cols = t.shape[1];
  if (count == 0 || cols == 0) return;
  const uint64_t r0 = first / cols, r1 = (first + count + cols - 1) / cols;
  t.data_file->Prefetch(t.data_offset + r0 * (cols / 2), (r1 - r0) * (cols / 2));
  t.scale_file->Prefetch(t.scale_offset + r0 * (cols / kNvfp4Block), (r1 - r0) * (cols / kNvfp4Block));
}

}  // namespace

extern const QuantFormat kNvfp4Format{"nvfp4", /*packing=*/2, "nvfp4", "nvfp4 scale",
                                      Detect, SameKey, ModelShape, SameShape, Consumed,
                                      DequantizesTo, Bind, SourceBytes, Read, Prefetch};

}  // namespace shardcast
