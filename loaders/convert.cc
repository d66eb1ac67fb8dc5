#include "loaders/convert.h"

#include <algorithm>
#include <cstring>
#include <map>
#include <nlohmann/json.hpp>

#include "allocators/error.h"
#include "loaders/shape.h"
#include "allocators/lazy_zero.h"
#include "loaders/mxfp4.h"
#include "loaders/nvfp4.h"
#include "loaders/quantization.h"

namespace shardcast {
namespace {

const char* TorchDTypeName(DType t) {
  switch (t) {
    case DType::kBF16: return "bfloat16";
    case DType::kF16: return "float16";
    default: return "float32";
  }
}

bool EndsWith(const std::string& s, std::string_view suffix) {
  return s.size() > suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

std::string Nvfp4Base(const std::string& weight_key) { return weight_key.substr(0, weight_key.size() - 7); }

// Whether `t` is a ModelOpt NVFP4 weight: a U8 "<m>.weight" with "<m>.weight_scale" or
// "<m>.weight_scale_2" beside it. Throws kCheckpoint naming the key and the shapes when one of the
// two scales is missing or the three do not pair: packed bytes are never copied as the model's values.
bool IsNvfp4Weight(const Checkpoint& in, const TensorInfo& t) {
  if (t.dtype != DType::kU8 || !EndsWith(t.key, ".weight")) return false;
  const std::string base = Nvfp4Base(t.key);
  const Checkpoint::Entry* scale = in.Find(base + ".weight_scale");
  const Checkpoint::Entry* global = in.Find(base + ".weight_scale_2");
  if (scale == nullptr && global == nullptr) return false;
  if (scale == nullptr || global == nullptr) {
    throw Error(ErrorKind::kCheckpoint, "tensor '" + t.key + "'",
                "NVFP4 weight U8 " + ShapeText(t.shape) + " has no '" + base +
                    (scale ? ".weight_scale_2'" : ".weight_scale'") +
                    " (an NVFP4 weight is never read without its block scales and its global scale)");
  }
  CheckNvfp4Triple(t.key, t.dtype, t.shape, scale->info->dtype, scale->info->shape, global->info->dtype,
                   global->info->shape);
  return true;
}

// Whether `key` is a scale an NVFP4 weight consumes ("<m>.weight_scale", "_scale_2", "input_scale").
bool IsNvfp4Sidecar(const Checkpoint& in, const std::string& key) {
  for (std::string_view suffix : {".weight_scale", ".weight_scale_2", ".input_scale"}) {
    if (!EndsWith(key, suffix)) continue;
    const Checkpoint::Entry* w = in.Find(key.substr(0, key.size() - suffix.size()) + ".weight");
    return w != nullptr && IsNvfp4Weight(in, *w->info);
  }
  return false;
}

// An MXFP4 pair's blocks (gpt-oss): the scales are then its sidecar, and the output is the model's key.
bool IsMxfp4Blocks(const Checkpoint& in, const std::string& key) {
  return QuantOf(in, key).role == QuantRole::kMxfp4Blocks;
}

std::string Mxfp4ParamKey(const std::string& blocks_key) { return blocks_key.substr(0, blocks_key.size() - 7); }

// A lazy-zero scratch buffer, grown as needed and unmapped at the end.
class Scratch {
 public:
  ~Scratch() { LazyZeroFree(p_, n_); }
  unsigned char* Get(uint64_t n) {
    if (n > n_) {
      LazyZeroFree(p_, n_);
      p_ = nullptr;
      n_ = 0;
      p_ = static_cast<unsigned char*>(LazyZeroAllocate(n));
      n_ = n;
    }
    return p_;
  }

 private:
  unsigned char* p_ = nullptr;
  uint64_t n_ = 0;
};

// Produces bytes [offset, offset + n) of one output tensor.
class Producer {
 public:
  Producer(const Checkpoint& in, const ConvertOptions& o) : in_(in), o_(o) {}

  void Copy(const std::string& key, uint64_t offset, unsigned char* out, uint64_t n) {
    const Checkpoint::Entry& e = in_.Get(key);
    const uint64_t at = e.file->header().data_offset() + e.info->begin + offset;
    e.file->ReadBytes(at, n, out, "tensor '" + key + "'");
    e.file->ReleasePages(at, n);
  }

  // Dequantizes the rows that cover the requested bytes, then copies the part asked for.
  void Dequantized(const std::string& key, uint64_t offset, unsigned char* out, uint64_t n) {
    const Checkpoint::Entry& w = in_.Get(key);
    const Checkpoint::Entry& s = in_.Get(ScaleKeyFor(key));
    const uint64_t cols = w.info->shape[1], ts = DTypeSize(o_.target), row_bytes = cols * ts;
    const uint64_t r0 = offset / row_bytes, r1 = (offset + n + row_bytes - 1) / row_bytes;
    const RowSpan rows{r0, r1}, srows = ScaleRowsFor(rows, o_.block);
    const uint64_t grid_cols = s.info->shape[1], ss = DTypeSize(s.info->dtype);
    const uint64_t w_at = w.file->header().data_offset() + w.info->begin + r0 * cols;
    const uint64_t s_at = s.file->header().data_offset() + s.info->begin + srows.begin * grid_cols * ss;
    const uint64_t w_bytes = (r1 - r0) * cols, s_bytes = srows.size() * grid_cols * ss;
    unsigned char* raw = raw_.Get(w_bytes + s_bytes);
    w.file->ReadBytes(w_at, w_bytes, raw, "tensor '" + key + "'");
    s.file->ReadBytes(s_at, s_bytes, raw + w_bytes, "tensor '" + ScaleKeyFor(key) + "'");
    unsigned char* rows_out = rows_.Get((r1 - r0) * row_bytes);
    Dequantize(DequantSource{w.info->dtype, raw}, DequantScale{s.info->dtype, raw + w_bytes, grid_cols}, rows, cols,
               o_.block, o_.target, rows_out);
    std::memcpy(out, rows_out + (offset - r0 * row_bytes), n);
    w.file->ReleasePages(w_at, w_bytes);
  }

  // The model's [..., in, out] of an MXFP4 pair: each expert the requested bytes touch is read packed
  // (blocks and scales) and the rows asked for are written transposed, as the stream does.
  void Mxfp4(const std::string& key, uint64_t offset, unsigned char* out, uint64_t n) {
    const Checkpoint::Entry& b = in_.Get(Mxfp4BlocksKey(key));
    const Checkpoint::Entry& s = in_.Get(Mxfp4ScalesKey(key));
    const std::vector<uint64_t>& bs = b.info->shape;  // [..., out, in / 32, 16]
    const uint64_t rows_out = bs[bs.size() - 3], cols_in = bs[bs.size() - 2] * kMxfp4Group;
    const uint64_t ts = DTypeSize(o_.target), row_bytes = rows_out * ts, expert_rows = cols_in;
    const uint64_t r0 = offset / row_bytes, r1 = (offset + n + row_bytes - 1) / row_bytes;
    const uint64_t blocks_per_expert = rows_out * cols_in / 2, scales_per_expert = rows_out * cols_in / kMxfp4Group;
    const uint64_t ss = DTypeSize(s.info->dtype);
    unsigned char* rows_buf = rows_.Get((r1 - r0) * row_bytes);
    for (uint64_t r = r0; r < r1;) {
      const uint64_t e = r / expert_rows, i0 = r % expert_rows, i1 = std::min(expert_rows, i0 + (r1 - r));
      const uint64_t b_at = b.file->header().data_offset() + b.info->begin + e * blocks_per_expert;
      const uint64_t s_at = s.file->header().data_offset() + s.info->begin + e * scales_per_expert * ss;
      unsigned char* raw = raw_.Get(blocks_per_expert + scales_per_expert * ss);
      b.file->ReadBytes(b_at, blocks_per_expert, raw, "tensor '" + Mxfp4BlocksKey(key) + "'");
      s.file->ReadBytes(s_at, scales_per_expert * ss, raw + blocks_per_expert, "tensor '" + Mxfp4ScalesKey(key) + "'");
      DequantizeMxfp4Transposed(Mxfp4Matrix{raw, raw + blocks_per_expert, 0, cols_in},
                                OutputWindow{{i0, i1}, {0, rows_out}}, o_.target,
                                WindowOut{rows_buf + (r - r0) * row_bytes});
      b.file->ReleasePages(b_at, blocks_per_expert);
      r += i1 - i0;
    }
    std::memcpy(out, rows_buf + (offset - r0 * row_bytes), n);
  }

  // Dequantizes the NVFP4 rows that cover the requested bytes of [out, in], then copies the part asked for.
  void Nvfp4(const std::string& key, uint64_t offset, unsigned char* out, uint64_t n) {
    const std::string base = Nvfp4Base(key);
    const Checkpoint::Entry& w = in_.Get(key);
    const Checkpoint::Entry& s = in_.Get(base + ".weight_scale");
    const Checkpoint::Entry& g = in_.Get(base + ".weight_scale_2");
    const uint64_t cols = w.info->shape[1] * 2, ts = DTypeSize(o_.target), row_bytes = cols * ts;
    const uint64_t r0 = offset / row_bytes, r1 = (offset + n + row_bytes - 1) / row_bytes;
    const uint64_t w_at = w.file->header().data_offset() + w.info->begin + r0 * cols / 2;
    const uint64_t s_at = s.file->header().data_offset() + s.info->begin + r0 * cols / kNvfp4Block;
    const uint64_t w_bytes = (r1 - r0) * cols / 2, s_bytes = (r1 - r0) * cols / kNvfp4Block;
    unsigned char* raw = raw_.Get(w_bytes + s_bytes);
    w.file->ReadBytes(w_at, w_bytes, raw, "tensor '" + key + "'");
    s.file->ReadBytes(s_at, s_bytes, raw + w_bytes, "tensor '" + base + ".weight_scale'");
    float global;
    g.file->ReadBytes(g.file->header().data_offset() + g.info->begin, 4, &global, "tensor '" + base + ".weight_scale_2'");
    unsigned char* rows_out = rows_.Get((r1 - r0) * row_bytes);
    DequantizeNvfp4(Nvfp4Matrix{raw, raw + w_bytes, global, r0, cols}, OutputWindow{{r0, r1}, {0, cols}}, o_.target,
                    WindowOut{rows_out});
    std::memcpy(out, rows_out + (offset - r0 * row_bytes), n);
    w.file->ReleasePages(w_at, w_bytes);
  }

 private:
  const Checkpoint& in_;
  const ConvertOptions& o_;
  Scratch raw_, rows_;
};

}  // namespace

ConvertPlan PlanConvert(const Checkpoint& in, const ConvertOptions& o) {
  if (o.target != DType::kBF16 && o.target != DType::kF16 && o.target != DType::kF32) {
    throw Error(ErrorKind::kInvalidArgument, "--dtype",
                std::string(DTypeName(o.target)) + " is not a dequantization target (BF16, F16 or F32)");
  }
  ConvertPlan plan;
  std::vector<WriteEntry> entries;
  for (size_t f = 0; f < in.num_files(); ++f) {
    const SafetensorsFile& file = in.file(f);
    std::vector<const TensorInfo*> order;
    for (const TensorInfo& t : file.header().tensors) order.push_back(&t);
    std::sort(order.begin(), order.end(), [](const TensorInfo* a, const TensorInfo* b) { return a->begin < b->begin; });
    for (const TensorInfo* t : order) {
      plan.input_bytes += t->nbytes();
      if (IsNvfp4Sidecar(in, t->key)) {
        ++plan.dropped_scales;  // consumed by its NVFP4 weight's dequantization (input_scale: dropped)
        continue;
      }
      if (QuantOf(in, t->key).role == QuantRole::kMxfp4Scales) {
        ++plan.dropped_scales;  // consumed by its blocks' dequantization
        continue;
      }
      const bool is_scale = t->key.size() > 10 && t->key.compare(t->key.size() - 10, 10, "_scale_inv") == 0;
      if (is_scale) {
        const Checkpoint::Entry* weight = in.Find(t->key.substr(0, t->key.size() - 10));
        if (weight != nullptr && IsFp8(weight->info->dtype)) {
          ++plan.dropped_scales;  // consumed by its weight's dequantization
          continue;
        }
      }
      ConvertPlan::Output out{t->key, t->dtype, false};
      WriteEntry e{t->key, t->dtype, t->shape};
      if (IsMxfp4Blocks(in, t->key)) {
        const std::string key = Mxfp4ParamKey(t->key);
        const Checkpoint::Entry& scales = in.Get(Mxfp4ScalesKey(key));
        const std::vector<uint64_t> shape = Mxfp4ModelShape(t->shape);
        CheckMxfp4Pair(key, t->dtype, t->shape, scales.info->dtype, scales.info->shape, shape, o.target);
        out = ConvertPlan::Output{key, t->dtype, false};
        out.mxfp4 = true;
        e = WriteEntry{key, o.target, shape};
        ++plan.dequantized;
      } else if (IsNvfp4Weight(in, *t)) {
        out.nvfp4 = true;
        e.dtype = o.target;
        e.shape = {t->shape[0], t->shape[1] * 2};
        ++plan.dequantized;
      } else if (IsFp8(t->dtype)) {
        const Checkpoint::Entry* scale = in.Find(ScaleKeyFor(t->key));
        if (scale == nullptr) {
          throw Error(ErrorKind::kCheckpoint, "tensor '" + t->key + "' in " + file.path(),
                      std::string(DTypeName(t->dtype)) + " without '" + ScaleKeyFor(t->key) +
                          "': an fp8 tensor is never cast without its scale");
        }
        CheckDequantizable(t->key, t->dtype, scale->info->dtype, o.target);
        CheckScaleShape(t->key, t->shape, scale->info->shape, o.block);
        out.dequantize = true;
        e.dtype = o.target;
        ++plan.dequantized;
      } else {
        ++plan.copied;
      }
      plan.output_bytes += e.nbytes();
      plan.outputs.push_back(out);
      entries.push_back(e);
    }
  }
  plan.files = PlanCheckpointFiles(entries, o.max_shard_bytes);
  return plan;
}

void WriteConvertedFile(const Checkpoint& in, const ConvertPlan& plan, size_t file, const std::string& dir,
                        const ConvertOptions& o) {
  std::map<std::string, const ConvertPlan::Output*> by_key;
  for (const auto& out : plan.outputs) by_key[out.key] = &out;
  const CheckpointFile& f = plan.files.at(file);
  SafetensorsWriter w(dir + "/" + f.name, f.entries, {{"format", "pt"}});
  Producer produce(in, o);
  Scratch chunk;
  for (const WriteEntry& e : f.entries) {
    const ConvertPlan::Output& out = *by_key.at(e.key);
    const uint64_t total = e.nbytes();
    for (uint64_t off = 0; off < total; off += o.chunk_bytes) {
      const uint64_t n = std::min(o.chunk_bytes, total - off);
      unsigned char* buf = chunk.Get(n);
      if (out.mxfp4) {
        produce.Mxfp4(e.key, off, buf, n);
      } else if (out.nvfp4) {
        produce.Nvfp4(e.key, off, buf, n);
      } else if (out.dequantize) {
        produce.Dequantized(e.key, off, buf, n);
      } else {
        produce.Copy(e.key, off, buf, n);
      }
      w.Append(buf, n);
    }
  }
  w.Commit();
}

std::string ConvertedConfig(const std::string& config_json, DType target) {
  nlohmann::ordered_json j = nlohmann::ordered_json::parse(config_json, nullptr, /*allow_exceptions=*/false);
  if (!j.is_object()) throw Error(ErrorKind::kConfig, "config.json", "is not a JSON object");
  j.erase("quantization_config");
  j["torch_dtype"] = TorchDTypeName(target);
  if (j.contains("dtype")) j["dtype"] = TorchDTypeName(target);
  return j.dump(2) + "\n";
}

}  // namespace shardcast
