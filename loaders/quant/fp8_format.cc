// The fp8 block entry (DeepSeek-V3 and its kin): "<w>" F8_E4M3 / F8_E5M2 [rows, cols] with
// "<w>_scale_inv" [ceil(rows / bh), ceil(cols / bw)], one scale per block of the config's
// weight_block_size (loaders/quant/dequant.h has the rule and the kernel). The model's tensor is the
// stored shape.
//
//   rows  |  r0 ......... r1 |            scale rows [r0 / bh, ceil(r1 / bh)), grid_cols wide
//   blocks   |-- bh --|-- bh --|-- bh --|  (a read that starts mid-block reads its block's row)
//
// A read dequantizes whole rows, about kStepBytes of fp8 at a time; a cut row is dequantized whole
// (its blocks need whole block rows anyway) and the part asked for copied out.
#include <algorithm>
#include <cstring>

#include "allocators/error.h"
#include "loaders/quant/entry_util.h"

namespace shardcast {
namespace {
using namespace quant_internal;

constexpr std::string_view kScaleInv = "_scale_inv";
constexpr uint64_t kStepBytes = 8ull << 20;

// Any fp8 tensor is claimed (a read never casts one without its scale); complete with its scale.
QuantMatch Detect(const FindStored& find, const std::string& key) {
  if (EndsWith(key, kScaleInv)) {
    const std::string w = Strip(key, kScaleInv);
    if (auto t = find(w); t && IsFp8(t->dtype)) return Match(kFp8Format, QuantPiece::kScale, w, w, w, true);
  }
  if (!IsFp8(find(key)->dtype)) return {};
  const std::string scale = ScaleKeyFor(key);
  return Match(kFp8Format, QuantPiece::kData, key, key, scale, find(scale).has_value());
}

std::vector<std::string> Consumed(const std::string& key) { return {ScaleKeyFor(key)}; }

bool DequantizesTo(DType target) { return IsFloatingPoint(target) && !IsFp8(target); }

PackedTensor Bind(const Checkpoint& ckpt, const std::string& key, const BindRequest& r) {
  const Checkpoint::Entry& w = ckpt.Get(key);
  const std::string scale_key = ScaleKeyFor(key);
  const Checkpoint::Entry* scale = ckpt.Find(scale_key);
  if (scale == nullptr) {
    throw Error(ErrorKind::kCheckpoint, r.context,
                "'" + key + "' in " + w.file->path() + " is " + std::string(DTypeName(w.info->dtype)) +
                    " but the checkpoint has no '" + scale_key + "' to dequantize it to " +
                    std::string(DTypeName(r.target)) + " (an fp8 weight is never cast without its scale)");
  }
  CheckDequantizable(key, w.info->dtype, scale->info->dtype, r.target);
  CheckScaleShape(key, w.info->shape, scale->info->shape, r.block);
  PackedTensor t;
  t.data_key = key;
  t.data_dtype = w.info->dtype;
  t.data_file = w.file;
  t.data_offset = DataOffset(w);
  t.shape = w.info->shape;
  t.scale_key = scale_key;
  t.scale_dtype = scale->info->dtype;
  t.scale_file = scale->file;
  t.scale_offset = DataOffset(*scale);
  t.grid_rows = scale->info->shape[0];
  t.grid_cols = scale->info->shape[1];
  t.block = r.block;
  return t;
}

uint64_t SourceBytes(const PackedTensor& t) {
  return Numel(t.shape) * DTypeSize(t.data_dtype) + t.grid_rows * t.grid_cols * DTypeSize(t.scale_dtype);
}

// Rows [r0, r1): their bytes and the scale rows they need, dequantized into `out`.
void ReadRows(const PackedTensor& t, uint64_t r0, uint64_t r1, const ReadRequest& r, unsigned char* raw,
              unsigned char* out) {
  const uint64_t cols = t.shape[1], ss = DTypeSize(t.scale_dtype);
  const RowSpan rows{r0, r1}, scale_rows = ScaleRowsFor(rows, t.block);
  const uint64_t s_bytes = scale_rows.size() * t.grid_cols * ss;
  const uint64_t s_at = t.scale_offset + scale_rows.begin * t.grid_cols * ss;
  const uint64_t w_at = t.data_offset + r0 * cols * DTypeSize(t.data_dtype), w_bytes = (r1 - r0) * cols;
  t.data_file->ReadBytes(w_at, w_bytes, raw, "tensor '" + t.data_key + "'");
  t.scale_file->ReadBytes(s_at, s_bytes, raw + w_bytes, "tensor '" + t.scale_key + "'");
  Dequantize(DequantSource{t.data_dtype, raw}, DequantScale{t.scale_dtype, raw + w_bytes, t.grid_cols}, rows, cols,
             t.block, r.target, out);
  if (r.release) {
    t.data_file->ReleasePages(w_at, w_bytes);
    t.scale_file->ReleasePages(s_at, s_bytes);
  }
}

// The raw bytes `rows` rows read: their fp8 values and their block rows' scales (one more block row
// for a span that straddles a block boundary).
uint64_t RawBytes(const PackedTensor& t, uint64_t rows) {
  const uint64_t scale_rows = rows / std::max<uint64_t>(1, t.block.rows) + 2;
  return rows * t.shape[1] + scale_rows * t.grid_cols * DTypeSize(t.scale_dtype);
}

void Read(const PackedTensor& t, const ReadRequest& r, const ScratchFn& scratch, unsigned char* out) {
  const uint64_t cols = t.shape.size() == 2 ? t.shape[1] : 0, ts = DTypeSize(r.target);
  if (r.count == 0 || cols == 0) return;
  const uint64_t step = std::max<uint64_t>(1, kStepBytes / cols);
  for (uint64_t at = r.first, end = r.first + r.count; at < end;) {
    const uint64_t row = at / cols, c = at % cols;
    if (c == 0 && end - at >= cols) {  // whole rows
      const uint64_t rows = std::min(step, (end - at) / cols);
      ReadRows(t, row, row + rows, r, scratch(RawBytes(t, rows)), out + (at - r.first) * ts);
      at += rows * cols;
      continue;
    }
    const uint64_t k = std::min(end - at, cols - c), raw_bytes = RawBytes(t, 1);
    unsigned char* buf = scratch(raw_bytes + cols * ts);
    ReadRows(t, row, row + 1, r, buf, buf + raw_bytes);
    std::memcpy(out + (at - r.first) * ts, buf + raw_bytes + c * ts, k * ts);
    at += k;
  }
}

void Prefetch(const PackedTensor& t, uint64_t first, uint64_t count) {
  const uint64_t cols = t.shape.size() == 2 ? t.shape[1] : 0;
  if (count == 0 || cols == 0) return;
  t.data_file->Prefetch(t.data_offset + first * DTypeSize(t.data_dtype), count * DTypeSize(t.data_dtype));
  const RowSpan rows = ScaleRowsFor({first / cols, (first + count + cols - 1) / cols}, t.block);
  const uint64_t ss = DTypeSize(t.scale_dtype);
  t.scale_file->Prefetch(t.scale_offset + rows.begin * t.grid_cols * ss, rows.size() * t.grid_cols * ss);
}

}  // namespace

// Packing 0: the manifest's plain layout, with dequantize and block scales (read by runtime/stream/source.cc).
extern const QuantFormat kFp8Format{"fp8", /*packing=*/0, "fp8", "fp8 scale",
                                    Detect, SameKey, SameShape, SameShape, Consumed,
                                    DequantizesTo, Bind, SourceBytes, Read, Prefetch};

}  // namespace shardcast
