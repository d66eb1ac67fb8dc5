#include "loaders/convert.h"

#include <algorithm>
#include <cstring>
#include <map>
#include <optional>
#include <nlohmann/json.hpp>

#include "allocators/error.h"
#include "allocators/scratch_buffer.h"
#include "loaders/quant/format.h"
#include "loaders/shape.h"

namespace shardcast {
namespace {

const char* TorchDTypeName(DType t) {
  switch (t) {
    case DType::kBF16: return "bfloat16";
    case DType::kF16: return "float16";
    default: return "float32";
  }
}

// What a quantized input tensor is checked against and dequantized to.
BindRequest BindFor(const std::string& key, const ConvertOptions& o) {
  BindRequest r;
  r.context = "tensor '" + key + "'";
  r.target = o.target;
  r.block = o.block;
  return r;
}

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

  // Bytes [offset, offset + n) of a quantized tensor's dequantized elements: the elements that cover
  // them are read by the format (its kernel, release on), then the part asked for copied out.
  void Quantized(const QuantFormat& f, const PackedTensor& t, uint64_t offset, unsigned char* out, uint64_t n) {
    const uint64_t ts = DTypeSize(o_.target), e0 = offset / ts, e1 = (offset + n + ts - 1) / ts;
    unsigned char* elems = rows_.Get((e1 - e0) * ts);
    const ReadRequest r{e0, e1 - e0, o_.target, /*release=*/true};
    f.read(t, r, [this](uint64_t bytes) { return raw_.Get(bytes); }, elems);
    std::memcpy(out, elems + (offset - e0 * ts), n);
  }

 private:
  const Checkpoint& in_;
  const ConvertOptions& o_;
  ScratchBuffer raw_, rows_;
};

}  // namespace

ConvertPlan PlanConvert(const Checkpoint& in, const ConvertOptions& o) {
  if (o.target != DType::kBF16 && o.target != DType::kF16 && o.target != DType::kF32) {
    throw Error(ErrorKind::kInvalidArgument, "--dtype",
                std::string(DTypeName(o.target)) + " is not a dequantization target (BF16, F16 or F32)");
  }
  ConvertPlan plan;
  std::vector<WriteEntry> entries;
  const FindStored find = FindIn(in);
  for (size_t f = 0; f < in.num_files(); ++f) {
    const SafetensorsFile& file = in.file(f);
    std::vector<const TensorInfo*> order;
    for (const TensorInfo& t : file.header().tensors) order.push_back(&t);
    std::sort(order.begin(), order.end(), [](const TensorInfo* a, const TensorInfo* b) { return a->begin < b->begin; });
    for (const TensorInfo* t : order) {
      plan.input_bytes += t->nbytes();
      const QuantMatch m = DetectQuant(find, t->key);
      if (m.piece == QuantPiece::kScale || m.piece == QuantPiece::kSidecar) {
        ++plan.dropped_scales;  // consumed by its data's dequantization (NVFP4's input_scale: dropped)
        continue;
      }
      ConvertPlan::Output out{t->key, t->dtype, nullptr, ""};
      WriteEntry e{t->key, t->dtype, t->shape};
      if (m.piece == QuantPiece::kData) {
        m.format->bind(in, t->key, BindFor(t->key, o));  // checks the pieces pair: never a raw cast
        out = ConvertPlan::Output{m.model_key, t->dtype, m.format, t->key};
        e = WriteEntry{m.model_key, o.target, m.format->model_shape(t->shape)};
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
  ScratchBuffer chunk;
  for (const WriteEntry& e : f.entries) {
    const ConvertPlan::Output& out = *by_key.at(e.key);
    std::optional<PackedTensor> packed;
    if (out.format != nullptr) packed = out.format->bind(in, out.source_key, BindFor(out.source_key, o));
    const uint64_t total = e.nbytes();
    for (uint64_t off = 0; off < total; off += o.chunk_bytes) {
      const uint64_t n = std::min(o.chunk_bytes, total - off);
      unsigned char* buf = chunk.Get(n);
      if (packed) {
        produce.Quantized(*out.format, *packed, off, buf, n);
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
