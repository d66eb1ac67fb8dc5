// The MXFP4 entry (gpt-oss): "<p>_blocks" U8 [..., out, in / 32, 16] + "<p>_scales" [..., out, in / 32]
// hold the model's "<p>" [..., in, out] (loaders/quant/mxfp4.h has the rule and the kernel).
//
// A read produces elements [first, first + n) of the model's tensor one expert at a time:
//
//   model [E, in, out], elements [first, first + n)        expert e, stored [out, in/32, 16] + scales
//   e0: |......[=========|  <- tail rows of e0             read e's packed bytes (out x in / 2 + out x
//   e1: |================|  <- all of e1                   in / 32 bytes: a quarter of its bf16 size)
//   e2: |======].........|  <- head rows of e2             into scratch, then DequantizeMxfp4Transposed
//                                                          writes the window's rows straight into `out`
//
// So a reader holds one expert's packed bytes (8.3 MiB for gpt-oss-120b's gate_up_proj), never a
// dequantized expert. A window that starts or ends inside an expert reads that whole expert.
#include <algorithm>

#include "allocators/error.h"
#include "loaders/quant/mxfp4.h"
#include "loaders/quant/entry_util.h"

namespace shardcast {
namespace {
using namespace quant_internal;

constexpr std::string_view kBlocks = "_blocks", kScales = "_scales";

QuantMatch Detect(const FindStored& find, const std::string& key) {
  if (EndsWith(key, kBlocks)) {
    // Packed bytes, or anything beside its scales (bind then names the dtype): a float tensor that only
    // ends in "_blocks" is an ordinary one.
    const std::string param = Strip(key, kBlocks), scales = Mxfp4ScalesKey(param);
    const bool u8 = find(key)->dtype == DType::kU8, paired = find(scales).has_value();
    if (!u8 && !paired) return {};
    return Match(kMxfp4Format, QuantPiece::kData, key, param, scales, u8 && paired);
  }
  if (EndsWith(key, kScales)) {
    const std::string param = Strip(key, kScales), blocks = Mxfp4BlocksKey(param);
    if (auto b = find(blocks); b && b->dtype == DType::kU8) {
      return Match(kMxfp4Format, QuantPiece::kScale, blocks, param, blocks, true);
    }
  }
  return {};
}

// [..., out, g, 16] -> [..., g * 32, out], the transpose the reader claims; CheckMxfp4Pair then names a
// last dim other than 16. {} for fewer than 3 dims.
std::string StoredKey(const std::string& model_key) { return Mxfp4BlocksKey(model_key); }

std::vector<uint64_t> ModelShape(const std::vector<uint64_t>& b) {
  if (b.size() < 3) return {};
  std::vector<uint64_t> out(b.begin(), b.end() - 3);
  out.push_back(b[b.size() - 2] * kMxfp4Group);
  out.push_back(b[b.size() - 3]);
  return out;
}

// [..., out, g, 16] -> [..., out, g * 16], as transformers' Mxfp4GptOssExperts holds it kept quantized.
std::vector<uint64_t> KeptShape(const std::vector<uint64_t>& b) {
  if (b.size() < 3) return {};
  std::vector<uint64_t> out(b.begin(), b.end() - 2);
  out.push_back(b[b.size() - 2] * b.back());
  return out;
}

std::vector<std::string> Consumed(const std::string& blocks_key) {
  return {Mxfp4ScalesKey(Strip(blocks_key, kBlocks))};
}

bool DequantizesTo(DType target) { return target != DType::kU8; }

PackedTensor Bind(const Checkpoint& ckpt, const std::string& blocks_key, const BindRequest& r) {
  const std::string param = Strip(blocks_key, kBlocks), scales_key = Mxfp4ScalesKey(param);
  const Checkpoint::Entry& blocks = ckpt.Get(blocks_key);
  const std::vector<uint64_t>& bs = blocks.info->shape;
  const std::vector<uint64_t> shape = r.model_shape ? *r.model_shape : ModelShape(bs);
  const Checkpoint::Entry* scales = ckpt.Find(scales_key);
  if (scales == nullptr) {
    throw Error(ErrorKind::kCheckpoint, r.context,
                "'" + blocks_key + "' " + ShapeText(bs) + " in " + blocks.file->path() + " has no '" + scales_key +
                    "' to dequantize it to the model's " + ShapeText(shape) +
                    " (MXFP4 blocks are never read without their scales)");
  }
  CheckMxfp4Pair(param, blocks.info->dtype, bs, scales->info->dtype, scales->info->shape, shape, r.target);
  PackedTensor t;
  t.data_key = blocks_key;
  t.data_dtype = blocks.info->dtype;
  t.data_file = blocks.file;
  t.data_offset = DataOffset(blocks);
  t.shape = shape;
  t.scale_key = scales_key;
  t.scale_dtype = scales->info->dtype;
  t.scale_file = scales->file;
  t.scale_offset = DataOffset(*scales);
  t.grid_cols = scales->info->shape.back();
  t.grid_rows = t.grid_cols ? Numel(scales->info->shape) / t.grid_cols : 0;
  t.block = BlockSize{1, kMxfp4Group};
  return t;
}

uint64_t SourceBytes(const PackedTensor& t) { return Numel(t.shape) / 2 + t.grid_rows * t.grid_cols; }

// The model's tensor as experts of [in, out] (its last two dims; the leading ones are experts).
struct Experts {
  uint64_t in = 0, out = 0;
  explicit Experts(const PackedTensor& t) : in(t.shape[t.shape.size() - 2]), out(t.shape.back()) {}
  uint64_t elems() const { return in * out; }                       // of the model's tensor, per expert
  uint64_t block_bytes() const { return out * in / 2; }             // packed, per expert
  uint64_t scale_bytes() const { return out * (in / kMxfp4Group); }  // E8M0, per expert
};

void Read(const PackedTensor& t, const ReadRequest& r, const ScratchFn& scratch, unsigned char* out) {
  const Experts x(t);
  if (r.count == 0 || x.elems() == 0) return;
  const size_t ts = DTypeSize(r.target);
  const uint64_t bb = x.block_bytes(), sb = x.scale_bytes(), end = r.first + r.count;
  for (uint64_t at = r.first; at < end;) {
    // Expert e's elements [a, b) of this call, from its packed bytes read whole.
    const uint64_t e = at / x.elems(), base = e * x.elems();
    uint64_t a = at - base;
    const uint64_t b = std::min(end - base, x.elems());
    unsigned char* raw = scratch(bb + sb);
    const uint64_t b_at = t.data_offset + e * bb, s_at = t.scale_offset + e * sb;
    t.data_file->ReadBytes(b_at, bb, raw, "tensor '" + t.data_key + "'");
    t.scale_file->ReadBytes(s_at, sb, raw + bb, "tensor '" + t.scale_key + "'");
    const Mxfp4Matrix m{raw, raw + bb, 0, x.in};
    while (a < b) {  // whole rows of the expert's [in, out] in one window, a cut row in its own
      const uint64_t i = a / x.out, c0 = a % x.out;
      const uint64_t rows = c0 == 0 ? (b - a) / x.out : 0;
      const OutputWindow w = rows > 0 ? OutputWindow{{i, i + rows}, {0, x.out}}
                                      : OutputWindow{{i, i + 1}, {c0, std::min(x.out, c0 + (b - a))}};
      DequantizeMxfp4Transposed(m, w, r.target, WindowOut{out + (base + a - r.first) * ts});
      a += w.rows.size() * w.cols.size();
    }
    if (r.release) {
      t.data_file->ReleasePages(b_at, bb);
      t.scale_file->ReleasePages(s_at, sb);
    }
    at = base + b;
  }
}

void Prefetch(const PackedTensor& t, uint64_t first, uint64_t count) {
  const Experts x(t);
  if (count == 0 || x.elems() == 0) return;
  const uint64_t e0 = first / x.elems(), e1 = (first + count - 1) / x.elems() + 1;
  t.data_file->Prefetch(t.data_offset + e0 * x.block_bytes(), (e1 - e0) * x.block_bytes());
  t.scale_file->Prefetch(t.scale_offset + e0 * x.scale_bytes(), (e1 - e0) * x.scale_bytes());
}

}  // namespace

extern const QuantFormat kMxfp4Format{"mxfp4", /*packing=*/1, "mxfp4", "mxfp4 scales",
                                      Detect, StoredKey, ModelShape, KeptShape, Consumed,
                                      DequantizesTo, Bind, SourceBytes, Read, Prefetch};

}  // namespace shardcast
