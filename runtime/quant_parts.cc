#include "runtime/quant_parts.h"

#include <algorithm>

#include "allocators/error.h"
#include "loaders/mxfp4.h"

namespace shardcast {
namespace {

std::string ShapeText(const std::vector<uint64_t>& s) {
  std::string out = "[";
  for (size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
  return out + "]";
}

uint64_t Numel(const std::vector<uint64_t>& s) {
  uint64_t n = 1;
  for (uint64_t d : s) n *= d;
  return n;
}

// An MXFP4 part as experts of [in, out] (the entry's last two dims; the leading ones are experts).
struct Experts {
  uint64_t in = 0, out = 0;
  explicit Experts(const ManifestPart& p) : in(p.shape[p.shape.size() - 2]), out(p.shape.back()) {}
  uint64_t elems() const { return in * out; }                       // of the entry, per expert
  uint64_t block_bytes() const { return out * in / 2; }             // packed, per expert
  uint64_t scale_bytes() const { return out * (in / kMxfp4Group); }  // E8M0, per expert
};

}  // namespace

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
  CheckMxfp4Pair(ck, blocks->info->dtype, blocks->info->shape, scales->info->dtype, scales->info->shape, shape, target);
  ManifestPart p{Mxfp4BlocksKey(ck), blocks->info->dtype, files.at(blocks->file),
                 blocks->file->header().data_offset() + blocks->info->begin, Numel(shape), shape};
  p.dequantize = true;
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
