#include "runtime/manifest/quant_parts.h"

#include "allocators/error.h"
#include "loaders/quant/format.h"
#include "loaders/shape.h"

namespace shardcast {

const QuantFormat& FormatOf(const ManifestPart& p) {
  const QuantFormat* f = p.dequantize ? QuantFormatOfPacking(static_cast<uint8_t>(p.packing)) : nullptr;
  if (f == nullptr) {
    throw Error(ErrorKind::kInternal, "tensor '" + std::string(p.checkpoint_key) + "'", "no quantized format packs it");
  }
  return *f;
}

namespace {

// The manifest part of a bound tensor: its bytes by file index, its format's packing; its key (unless it
// is `entry_key`, kept already) and shape kept by `m`.
ManifestPart PartOf(Manifest* m, const QuantFormat& f, const PackedTensor& t, const FileIndex& files,
                    std::string_view entry_key = {}) {
  ManifestPart p;
  p.checkpoint_key = t.data_key == entry_key ? entry_key : m->Keep(t.data_key);
  p.source_dtype = t.data_dtype;
  p.dequantize = true;
  p.packing = static_cast<Packing>(f.packing);
  p.file = files.at(t.data_file);
  p.offset = t.data_offset;
  p.numel = Numel(t.shape);
  p.shape = m->KeepShape(t.shape);
  ManifestScale sc;
  sc.key = t.scale_key;
  sc.dtype = t.scale_dtype;
  sc.file = files.at(t.scale_file);
  sc.offset = t.scale_offset;
  sc.grid_rows = t.grid_rows;
  sc.grid_cols = t.grid_cols;
  sc.block = t.block;
  sc.global_bits = t.global_bits;
  p.scale = m->KeepScale(std::move(sc));
  return p;
}

}  // namespace

PackedTensor PackedOf(const ManifestPart& p, const FileTable* files) {
  PackedTensor t;
  t.data_key = p.checkpoint_key;
  t.data_dtype = p.source_dtype;
  t.data_offset = p.offset;
  t.shape = p.shape;
  if (files != nullptr) t.data_file = (*files)[p.file];
  if (p.scale == nullptr) return t;
  const ManifestScale& sc = *p.scale;
  t.scale_key = sc.key;
  t.scale_dtype = sc.dtype;
  t.scale_offset = sc.offset;
  t.grid_rows = sc.grid_rows;
  t.grid_cols = sc.grid_cols;
  t.block = sc.block;
  t.global_bits = sc.global_bits;
  if (files != nullptr) t.scale_file = (*files)[sc.file];
  return t;
}

ManifestPart ResolveFp8Part(Manifest* manifest, const Checkpoint& ckpt, const FileIndex& files,
                            const std::string& model_key, std::string_view entry_key, const std::string& ck,
                            BlockSize block, DType target) {
  BindRequest r;
  r.context = "key '" + model_key + "'";
  r.target = target;
  r.block = block;
  return PartOf(manifest, kFp8Format, kFp8Format.bind(ckpt, ck, r), files, entry_key);
}

std::optional<ManifestPart> ResolveNvfp4Part(Manifest* manifest, const Checkpoint& ckpt, const FileIndex& files,
                                             const std::string& model_key, const std::string& ck, DType target) {
  const QuantFormat& f = kNvfp4Format;
  const QuantMatch m = f.detect(FindIn(ckpt), ck);
  if (m.piece != QuantPiece::kData || !f.dequantizes_to(target)) return std::nullopt;
  BindRequest r;
  r.context = "key '" + model_key + "'";
  r.target = target;
  return PartOf(manifest, f, f.bind(ckpt, ck, r), files);
}

std::vector<std::string> PackedConsumedKeys(const ManifestPart& p) {
  return FormatOf(p).consumed(std::string(p.checkpoint_key));
}

std::optional<ManifestPart> ResolveMxfp4Part(Manifest* manifest, const Checkpoint& ckpt, const FileIndex& files,
                                             const std::string& model_key, const std::string& ck,
                                             const std::vector<uint64_t>& shape, DType target) {
  const QuantFormat& f = kMxfp4Format;
  const std::string stored = f.stored_key(ck);
  const Checkpoint::Entry* data = ckpt.Find(stored);
  if (data == nullptr) return std::nullopt;
  BindRequest r;
  r.context = "key '" + model_key + "'";
  r.target = target;
  r.model_shape = &shape;
  // Blocks without their scales are that first, whatever the target: bind names the missing scales.
  if (!ckpt.Find(f.detect(FindIn(ckpt), stored).partner)) f.bind(ckpt, stored, r);
  if (!f.dequantizes_to(target)) {  // kept quantized, but not in the shape the model keeps it in
    const std::vector<uint64_t>& bs = data->info->shape;
    throw Error(ErrorKind::kManifestMismatch, "key '" + model_key + "'",
                "'" + stored + "' " + ShapeText(bs) + " in " + data->file->path() + " kept quantized is " +
                    ShapeText(bs.size() >= 3 ? f.kept_shape(bs) : bs) +
                    " ([..., out, in / 2], as transformers' Mxfp4GptOssExperts holds it) but rank 0's plan has " +
                    ShapeText(shape));
  }
  return PartOf(manifest, f, f.bind(ckpt, stored, r), files);
}

uint64_t PackedSourceBytes(const ManifestPart& p) { return FormatOf(p).source_bytes(PackedOf(p, nullptr)); }

}  // namespace shardcast
