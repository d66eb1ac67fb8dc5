#include "runtime/quant_parts.h"

#include <algorithm>
#include <cstring>

#include "allocators/error.h"
#include "loaders/shape.h"
#include "loaders/mxfp4.h"
#include "loaders/nvfp4.h"

namespace shardcast {
namespace {

// An MXFP4 part as experts of [in, out] (the entry's last two dims; the leading ones are experts).
struct Experts {
  uint64_t in = 0, out = 0;
  explicit Experts(const ManifestPart& p) : in(p.shape[p.shape.size() - 2]), out(p.shape.back()) {}
  uint64_t elems() const { return in * out; }                       // of the entry, per expert
  uint64_t block_bytes() const { return out * in / 2; }             // packed, per expert
  uint64_t scale_bytes() const { return out * (in / kMxfp4Group); }  // E8M0, per expert
};

constexpr uint64_t kNvfp4StepBytes = 8ull << 20;  // packed bytes read, dequantized and released at a time

bool EndsWith(const std::string& s, std::string_view suffix) {
  return s.size() > suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

std::string TensorText(const Checkpoint::Entry& e, const std::string& key) {
  return "'" + key + "' " + std::string(DTypeName(e.info->dtype)) + " " + ShapeText(e.info->shape);
}

}  // namespace

std::optional<ManifestPart> ResolveNvfp4Part(const Checkpoint& ckpt, const FileIndex& files, const std::string& model_key,
                                             const std::string& ck, const Checkpoint::Entry& found, DType target) {
  if (found.info->dtype != DType::kU8 || !IsFloatingPoint(target) || !EndsWith(ck, ".weight")) return std::nullopt;
  const std::string base = ck.substr(0, ck.size() - 7), scale_key = base + ".weight_scale";
  const std::string global_key = base + ".weight_scale_2";
  const Checkpoint::Entry* scale = ckpt.Find(scale_key);
  const Checkpoint::Entry* global = ckpt.Find(global_key);
  if (scale == nullptr && global == nullptr) return std::nullopt;
  if (scale == nullptr || global == nullptr) {
    const Checkpoint::Entry& has = scale ? *scale : *global;
    throw Error(ErrorKind::kCheckpoint, "key '" + model_key + "'",
                TensorText(found, ck) + " in " + found.file->path() + " has " +
                    TensorText(has, scale ? scale_key : global_key) + " but no '" + (scale ? global_key : scale_key) +
                    "' (an NVFP4 weight is never read without its block scales and its global scale)");
  }
  if (target != DType::kBF16 && target != DType::kF16 && target != DType::kF32) {
    throw Error(ErrorKind::kUnsupported, "key '" + model_key + "'",
                "NVFP4 weight '" + ck + "' cannot be dequantized to " + std::string(DTypeName(target)) +
                    " (targets: BF16, F16 or F32)");
  }
  CheckNvfp4Triple(ck, found.info->dtype, found.info->shape, scale->info->dtype, scale->info->shape,
                   global->info->dtype, global->info->shape);
  const uint64_t out = found.info->shape[0], in = found.info->shape[1] * 2;
  ManifestPart p{ck, DType::kU8, files.at(found.file), found.file->header().data_offset() + found.info->begin, out * in,
                 {out, in}, /*dequantize=*/true, ManifestScale{}};
  p.packing = Packing::kNvfp4;
  ManifestScale& sc = p.scale;
  sc.key = scale_key;
  sc.dtype = scale->info->dtype;
  sc.file = files.at(scale->file);
  sc.offset = scale->file->header().data_offset() + scale->info->begin;
  sc.grid_rows = out;
  sc.grid_cols = in / kNvfp4Block;
  sc.block = BlockSize{1, kNvfp4Block};
  global->file->ReadBytes(global->file->header().data_offset() + global->info->begin, 4, &sc.global_bits,
                          "tensor '" + global_key + "'");
  return p;
}

std::vector<std::string> Nvfp4ConsumedKeys(const ManifestPart& p) {
  const std::string base = p.scale.key.substr(0, p.scale.key.size() - std::string_view(".weight_scale").size());
  return {p.scale.key, base + ".weight_scale_2", base + ".input_scale"};
}

uint64_t Nvfp4SourceBytes(const ManifestPart& p) { return p.numel / 2 + p.numel / kNvfp4Block; }

void ReadNvfp4(const ManifestPart& p, const FileTable& files, uint64_t first, uint64_t count, DType target,
               Buffer* scratch, bool release, unsigned char* out) {
  const uint64_t cols = p.shape[1];
  if (count == 0 || cols == 0) return;
  const SafetensorsFile& vf = *files[p.file];
  const SafetensorsFile& sf = *files[p.scale.file];
  float global;
  std::memcpy(&global, &p.scale.global_bits, 4);
  const uint64_t row_bytes = cols / 2, row_scales = cols / kNvfp4Block, ts = DTypeSize(target);
  const uint64_t step_rows = std::max<uint64_t>(1, kNvfp4StepBytes / row_bytes);
  for (uint64_t at = first, end = first + count; at < end;) {
    // Whole rows from r (up to step_rows), or the 16-value blocks [b0, b1) of one cut row.
    const uint64_t r = at / cols, c0 = at % cols;
    const bool whole = c0 == 0 && end - at >= cols;
    const uint64_t rows = whole ? std::min(step_rows, (end - at) / cols) : 1;
    const uint64_t c1 = whole ? cols : std::min(cols, c0 + (end - at));
    const uint64_t b0 = c0 / kNvfp4Block, b1 = (c1 + kNvfp4Block - 1) / kNvfp4Block;
    const uint64_t v_bytes = rows * (b1 - b0) * kNvfp4Block / 2, s_bytes = rows * (b1 - b0);
    const uint64_t v_at = p.offset + r * row_bytes + b0 * kNvfp4Block / 2, s_at = p.scale.offset + r * row_scales + b0;
    unsigned char* raw = scratch->Get(v_bytes + s_bytes);
    vf.ReadBytes(v_at, v_bytes, raw, "tensor '" + p.checkpoint_key + "'");
    sf.ReadBytes(s_at, s_bytes, raw + v_bytes, "tensor '" + p.scale.key + "'");
    const Nvfp4Matrix m{raw, raw + v_bytes, global, r, (b1 - b0) * kNvfp4Block};
    const uint64_t w0 = b0 * kNvfp4Block;
    DequantizeNvfp4(m, OutputWindow{{r, r + rows}, {c0 - w0, c1 - w0}}, target, WindowOut{out + (at - first) * ts});
    if (release) {
      vf.ReleasePages(v_at, v_bytes);
      sf.ReleasePages(s_at, s_bytes);
    }
    at += rows * (c1 - c0);
  }
}

void PrefetchNvfp4(const ManifestPart& p, const FileTable& files, uint64_t first, uint64_t count) {
  const uint64_t cols = p.shape[1];
  if (count == 0 || cols == 0) return;
  const uint64_t r0 = first / cols, r1 = (first + count + cols - 1) / cols;
  files[p.file]->Prefetch(p.offset + r0 * (cols / 2), (r1 - r0) * (cols / 2));
  files[p.scale.file]->Prefetch(p.scale.offset + r0 * (cols / kNvfp4Block), (r1 - r0) * (cols / kNvfp4Block));
}

std::optional<ManifestPart> ResolveMxfp4Part(const Checkpoint& ckpt, const FileIndex& files, const std::string& model_key,
                                             const std::string& ck, const std::vector<uint64_t>& shape, DType target) {
  const Checkpoint::Entry* blocks = ckpt.Find(Mxfp4BlocksKey(ck));
  if (blocks == nullptr) return std::nullopt;
  const Checkpoint::Entry* scales = ckpt.Find(Mxfp4ScalesKey(ck));
  if (scales == nullptr) {
    throw Error(ErrorKind::kCheckpoint, "key '" + model_key + "'",
                "'" + Mxfp4BlocksKey(ck) + "' " + ShapeText(blocks->info->shape) + " in " + blocks->file->path() +
                    " has no '" + Mxfp4ScalesKey(ck) + "' to dequantize it to the model's " + ShapeText(shape) +
                    " (MXFP4 blocks are never read without their scales)");
  }
  const std::vector<uint64_t>& bs = blocks->info->shape;
  if (target == DType::kU8 && bs.size() >= 2) {  // kept quantized, but not the blocks' merged shape
    std::vector<uint64_t> merged(bs.begin(), bs.end() - 2);
    merged.push_back(bs[bs.size() - 2] * bs.back());
    throw Error(ErrorKind::kManifestMismatch, "key '" + model_key + "'",
                "'" + Mxfp4BlocksKey(ck) + "' " + ShapeText(bs) + " in " + blocks->file->path() +
                    " kept quantized is " + ShapeText(merged) + " ([..., out, in / 2], as transformers' "
                    "Mxfp4GptOssExperts holds it) but rank 0's plan has " + ShapeText(shape));
  }
  CheckMxfp4Pair(ck, blocks->info->dtype, bs, scales->info->dtype, scales->info->shape, shape, target);
  ManifestPart p{Mxfp4BlocksKey(ck), blocks->info->dtype, files.at(blocks->file),
                 blocks->file->header().data_offset() + blocks->info->begin, Numel(shape), shape,
                 /*dequantize=*/true, ManifestScale{}};
  p.packing = Packing::kMxfp4;
  ManifestScale& sc = p.scale;
  sc.key = Mxfp4ScalesKey(ck);
  sc.dtype = scales->info->dtype;
  sc.file = files.at(scales->file);
  sc.offset = scales->file->header().data_offset() + scales->info->begin;
  sc.grid_cols = scales->info->shape.back();
  sc.grid_rows = sc.grid_cols ? Numel(scales->info->shape) / sc.grid_cols : 0;
  sc.block = BlockSize{1, kMxfp4Group};
  return p;
}

uint64_t Mxfp4SourceBytes(const ManifestPart& p) { return p.numel / 2 + p.scale.grid_rows * p.scale.grid_cols; }

void ReadMxfp4(const ManifestPart& p, const FileTable& files, uint64_t first, uint64_t count, DType target,
               Buffer* scratch, bool release, unsigned char* out) {
  const Experts x(p);
  if (count == 0 || x.elems() == 0) return;
  const size_t ts = DTypeSize(target);
  const SafetensorsFile& bf = *files[p.file];
  const SafetensorsFile& sf = *files[p.scale.file];
  const uint64_t bb = x.block_bytes(), sb = x.scale_bytes(), end = first + count;
  for (uint64_t at = first; at < end;) {
    // Expert e's elements [a, b) of this call, from its packed bytes read whole.
    const uint64_t e = at / x.elems(), base = e * x.elems();
    uint64_t a = at - base;
    const uint64_t b = std::min(end - base, x.elems());
    unsigned char* raw = scratch->Get(bb + sb);
    const uint64_t b_at = p.offset + e * bb, s_at = p.scale.offset + e * sb;
    bf.ReadBytes(b_at, bb, raw, "tensor '" + p.checkpoint_key + "'");
    sf.ReadBytes(s_at, sb, raw + bb, "tensor '" + p.scale.key + "'");
    const Mxfp4Matrix m{raw, raw + bb, 0, x.in};
    while (a < b) {  // whole rows of the expert's [in, out] in one window, a cut row in its own
      const uint64_t i = a / x.out, c0 = a % x.out;
      const uint64_t rows = c0 == 0 ? (b - a) / x.out : 0;
      const OutputWindow w = rows > 0 ? OutputWindow{{i, i + rows}, {0, x.out}}
                                      : OutputWindow{{i, i + 1}, {c0, std::min(x.out, c0 + (b - a))}};
      DequantizeMxfp4Transposed(m, w, target, WindowOut{out + (base + a - first) * ts});
      a += w.rows.size() * w.cols.size();
    }
    if (release) {
      bf.ReleasePages(b_at, bb);
      sf.ReleasePages(s_at, sb);
    }
    at = base + b;
  }
}

void PrefetchMxfp4(const ManifestPart& p, const FileTable& files, uint64_t first, uint64_t count) {
  const Experts x(p);
  if (count == 0 || x.elems() == 0) return;
  const uint64_t e0 = first / x.elems(), e1 = (first + count - 1) / x.elems() + 1;
  files[p.file]->Prefetch(p.offset + e0 * x.block_bytes(), (e1 - e0) * x.block_bytes());
  files[p.scale.file]->Prefetch(p.scale.offset + e0 * x.scale_bytes(), (e1 - e0) * x.scale_bytes());
}

}  // namespace shardcast
