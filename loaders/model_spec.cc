#include "loaders/model_spec.h"

#include <fcntl.h>
#include <sys/stat.h>

#include <algorithm>
#include <map>
#include <optional>
#include <string_view>
#include <utility>

#include "allocators/error.h"
#include "loaders/checkpoint.h"
#include "loaders/posix_file.h"
#include "loaders/spec_builder.h"

namespace shardcast {
namespace spec_internal {

void Config::Fail(const std::string& what) const { throw Error(ErrorKind::kConfig, source_, what); }

const char* Config::Present(const char* field) const {
  static constexpr std::pair<std::string_view, const char*> kOtherName[] = {
      {"num_experts", "num_local_experts"}, {"num_local_experts", "num_experts"}};
  auto here = [&](const char* name) { return j_.contains(name) && !j_[name].is_null(); };
  const char* other = nullptr;
  for (const auto& [name, alias] : kOtherName) {
    if (name == field) other = alias;
  }
  if (other != nullptr && here(field) && here(other) && j_[field] != j_[other]) {
    Fail("fields \"" + std::string(field) + "\" (" + j_[field].dump() + ") and \"" + other + "\" (" +
         j_[other].dump() + ") name the same thing and differ");
  }
  if (here(field)) return field;
  return other != nullptr && here(other) ? other : nullptr;
}

uint64_t Config::Uint(const char* field) const {
  if (!Has(field)) Fail("missing field \"" + std::string(field) + "\"");
  return Uint(field, 0);
}

uint64_t Config::Uint(const char* field, uint64_t fallback) const {
  const char* name = Present(field);
  if (name == nullptr) return fallback;
  const auto& v = j_[name];
  if (!v.is_number_integer() || v.get<int64_t>() < 0) {
    Fail("field \"" + std::string(name) + "\" must be a non-negative integer, got " + v.dump());
  }
  return v.get<uint64_t>();
}

bool Config::Bool(const char* field, bool fallback) const {
  const char* name = Present(field);
  if (name == nullptr) return fallback;
  if (!j_[name].is_boolean()) Fail("field \"" + std::string(name) + "\" must be a boolean");
  return j_[name].get<bool>();
}

std::string Config::String(const char* field, const std::string& fallback) const {
  const char* name = Present(field);
  if (name == nullptr) return fallback;
  if (!j_[name].is_string()) Fail("field \"" + std::string(name) + "\" must be a string");
  return j_[name].get<std::string>();
}

SpecBuilder::SpecBuilder(const Config& config, ModelSpec* spec) : config_(config), spec_(spec) {
  std::string dt = config.String("torch_dtype", config.String("dtype", "bfloat16"));
  const std::optional<DType> parsed = ParseFloatDType(dt);
  if (!parsed) config.Fail("torch_dtype \"" + dt + "\" is not bfloat16, float16 or float32");
  dtype_ = *parsed;
  const auto& j = config.json();
  if (j.contains("quantization_config") && j["quantization_config"].is_object()) {
    const auto& q = j["quantization_config"];
    if (q.contains("weight_block_size")) {
      const auto& b = q["weight_block_size"];
      if (!b.is_array() || b.size() != 2 || !b[0].is_number_unsigned() || !b[1].is_number_unsigned() ||
          b[0].get<uint64_t>() == 0 || b[1].get<uint64_t>() == 0) {
        config.Fail("quantization_config.weight_block_size must be two positive integers, got " + b.dump());
      }
      block_out_ = b[0].get<uint64_t>();
      block_in_ = b[1].get<uint64_t>();
    }
    // ModelOpt writes {"quant_method": "modelopt", "quant_algo": "NVFP4" (or "W4A16_NVFP4"), "group_size": 16}.
    const bool modelopt = q.contains("quant_method") && q["quant_method"] == "modelopt";
    if (modelopt && q.contains("quant_algo") && q["quant_algo"].is_string() &&
        q["quant_algo"].get<std::string>().find("NVFP4") != std::string::npos) {
      if (q.contains("group_size") && !(q["group_size"].is_number_unsigned() && q["group_size"].get<uint64_t>() == 16)) {
        config.Fail("quantization_config.group_size must be 16 for NVFP4, got " + q["group_size"].dump());
      }
      nvfp4_ = true;
    }
  }
}

void SpecBuilder::Add(const std::string& key, std::vector<uint64_t> shape, Role role, DType dtype, int layer) {
  SpecEntry e;
  e.key = key;
  e.shape = std::move(shape);
  e.dtype = dtype;
  e.role = role;
  e.layer = layer;
  spec_->entries.push_back(std::move(e));
}

void SpecBuilder::Weight(const std::string& key, std::vector<uint64_t> shape, int layer) {
  Add(key, std::move(shape), Role::kParameter, dtype_, layer);
}

void SpecBuilder::Linear(const std::string& prefix, uint64_t out, uint64_t in, int layer, bool quantizable) {
  if (quantizable && block_out_ != 0) {
    Add(prefix + ".weight", {out, in}, Role::kParameter, DType::kF8_E4M3, layer);
    Add(prefix + ".weight_scale_inv", {(out + block_out_ - 1) / block_out_, (in + block_in_ - 1) / block_in_},
        Role::kSidecar, DType::kF32, layer);
  } else if (quantizable && nvfp4_ && in % 16 == 0) {
    Add(prefix + ".weight", {out, in / 2}, Role::kParameter, DType::kU8, layer);
    Add(prefix + ".weight_scale", {out, in / 16}, Role::kSidecar, DType::kF8_E4M3, layer);
    Add(prefix + ".weight_scale_2", {}, Role::kSidecar, DType::kF32, layer);
    Add(prefix + ".input_scale", {}, Role::kSidecar, DType::kF32, layer);
  } else {
    Weight(prefix + ".weight", {out, in}, layer);
  }
}

void SpecBuilder::RotaryInvFreq(uint64_t rotary_dim) {
  if (rotary_dim == 0 || rotary_dim % 2 != 0) {
    config_.Fail("rotary dimension must be a positive even number, got " + std::to_string(rotary_dim));
  }
  Add("model.rotary_emb.inv_freq", {rotary_dim / 2}, Role::kNonPersistentBuffer, DType::kF32);
  spec_->entries.back().init_rule = "rotary_inv_freq";
  spec_->entries.back().replicated = true;
}

void SpecBuilder::EmbeddingAndHead(uint64_t vocab, uint64_t hidden) {
  spec_->tie_word_embeddings = config_.Bool("tie_word_embeddings", false);
  Weight("model.norm.weight", {hidden});
  if (!spec_->tie_word_embeddings) Weight("lm_head.weight", {vocab, hidden});
}

void SpecBuilder::Layers(const std::function<void(int)>& body) {
  for (int i = 0; i < spec_->num_layers; ++i) body(i);
}

}  // namespace spec_internal

namespace {

using spec_internal::Builder;

const std::map<std::string, Builder>& Registry() {
  static const std::map<std::string, Builder> registry = {
      {"llama", spec_internal::BuildLlama},
      {"mixtral", spec_internal::BuildMixtral},
      {"qwen3_moe", spec_internal::BuildQwen3Moe},
      {"deepseek_v3", spec_internal::BuildDeepseekV3},
      {"minimax_m2", spec_internal::BuildMinimaxM2},
  };
  return registry;
}

}  // namespace

std::string_view RoleName(Role role) {
  switch (role) {
    case Role::kParameter: return "parameter";
    case Role::kPersistentBuffer: return "persistent_buffer";
    case Role::kNonPersistentBuffer: return "non_persistent_buffer";
    case Role::kSidecar: return "sidecar";
  }
  return "?";
}

uint64_t SpecEntry::numel() const {
  uint64_t n = 1;
  for (uint64_t d : shape) n *= d;
  return n;
}

uint64_t ModelSpec::parameter_count() const {
  uint64_t n = 0;
  for (const auto& e : entries) n += e.role == Role::kParameter ? e.numel() : 0;
  return n;
}

uint64_t ModelSpec::bytes(Role role) const {
  uint64_t n = 0;
  for (const auto& e : entries) n += e.role == role ? e.nbytes() : 0;
  return n;
}

const SpecEntry* ModelSpec::Find(std::string_view key) const {
  for (const auto& e : entries) {
    if (e.key == key) return &e;
  }
  return nullptr;
}

std::vector<std::string> KnownModelTypes() {
  std::vector<std::string> out;
  for (const auto& [name, _] : Registry()) out.push_back(name);
  return out;
}

ModelSpec BuildModelSpecFromJson(std::string_view source, std::string_view config_json, const SpecOptions& options) {
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(config_json);
  } catch (const nlohmann::json::exception& e) {
    throw Error(ErrorKind::kConfig, std::string(source), std::string("not valid JSON: ") + e.what());
  }
  if (!j.is_object()) throw Error(ErrorKind::kConfig, std::string(source), "config is not a JSON object");
  spec_internal::Config config(std::string(source), j);
  std::string type = config.String("model_type", "");
  auto it = Registry().find(type);
  if (it == Registry().end()) {
    std::string known;
    for (const auto& k : KnownModelTypes()) known += (known.empty() ? "" : ", ") + k;
    config.Fail(type.empty() ? "missing field \"model_type\" (known: " + known + ")"
                             : "unknown model_type \"" + type + "\" (known: " + known + ")");
  }
  ModelSpec spec;
  spec.source = std::string(source);
  spec.model_type = type;
  spec.config_json = std::string(config_json);
  spec.total_layers = static_cast<int>(config.Uint("num_hidden_layers"));
  spec.num_layers = options.layers < 0 ? spec.total_layers : std::min(options.layers, spec.total_layers);
  spec_internal::SpecBuilder builder(config, &spec);
  it->second(config, builder);
  return spec;
}

bool HasBuilderFor(std::string_view config_json) {
  const nlohmann::json j = nlohmann::json::parse(config_json, nullptr, /*allow_exceptions=*/false);
  if (!j.is_object() || !j.contains("model_type") || !j["model_type"].is_string()) return false;
  return Registry().count(j["model_type"].get<std::string>()) != 0;
}

namespace {

// N where `key` has a stack's ".<name>.N." (or starts "<name>.N."), the names transformers' models give their
// blocks: layers (llama and most), h (gpt2, falcon), layer (bert), block and blocks (t5, mpt); else -1.
// The first such name in the key is its stack: t5's "encoder.block.2.layer.0." is block 2.
int LayerOfKey(std::string_view key) {
  size_t best = std::string_view::npos;
  int layer = -1;
  for (std::string_view name : {"layers.", "h.", "layer.", "block.", "blocks."}) {
    for (size_t at = key.find(name); at != std::string_view::npos && at < best; at = key.find(name, at + 1)) {
      if (at != 0 && key[at - 1] != '.') continue;
      const size_t i = at + name.size();
      size_t end = i;
      while (end < key.size() && end - i < 9 && key[end] >= '0' && key[end] <= '9') ++end;
      if (end > i && end < key.size() && key[end] == '.') {
        best = at;
        layer = std::stoi(std::string(key.substr(i, end - i)));
        break;
      }
    }
  }
  return layer;
}

}  // namespace

ModelSpec SpecFromCheckpoint(const Checkpoint& checkpoint, std::string source, std::string model_type,
                             const SpecOptions& options) {
  if (checkpoint.num_keys() == 0) throw Error(ErrorKind::kCheckpoint, checkpoint.root(), "holds no tensor");
  ModelSpec spec;
  spec.source = std::move(source);
  spec.model_type = std::move(model_type);
  spec.config_json = "{}";  // no init rule reads it: the spec has no computed buffers
  int layers = 0;
  for (size_t i = 0; i < checkpoint.num_keys(); ++i) layers = std::max(layers, LayerOfKey(checkpoint.key(i)) + 1);
  spec.total_layers = layers;
  spec.num_layers = options.layers < 0 ? layers : std::min(options.layers, layers);
  for (size_t i = 0; i < checkpoint.num_keys(); ++i) {
    const TensorInfo& t = *checkpoint.Get(checkpoint.key(i)).info;
    const int layer = LayerOfKey(t.key);
    if (layer >= spec.num_layers) continue;
    SpecEntry e;
    e.key = t.key;
    e.shape = t.shape;
    e.dtype = t.dtype;
    e.role = Role::kParameter;
    e.layer = layer;
    spec.entries.push_back(std::move(e));
  }
  return spec;
}

namespace {

// Read like a checkpoint's files (posix_file.h): `node` was opened once without blocking on a FIFO;
// it must be a regular file of a sane size, and is read through its descriptor.
std::string ReadConfigNode(const std::optional<OpenNode>& node, const std::string& config_path) {
  constexpr uint64_t kMaxConfigBytes = 64ull << 20;  // published configs are a few KB
  if (!node) throw Error(ErrorKind::kConfig, config_path, "cannot open config file: no such file");
  if (!S_ISREG(node->st.st_mode)) {
    throw Error(ErrorKind::kConfig, config_path,
                std::string("is ") + FileKindText(node->st.st_mode) + ", not a regular file");
  }
  const auto size = static_cast<uint64_t>(node->st.st_size);
  if (size > kMaxConfigBytes) {
    throw Error(ErrorKind::kConfig, config_path,
                "is " + std::to_string(size) + " bytes, over the limit of " + std::to_string(kMaxConfigBytes));
  }
  return ReadWholeFile(node->fd.get(), size, config_path);
}

}  // namespace

std::string ReadConfigFile(const std::string& config_path) {
  std::optional<OpenNode> node;
  try {
    node = OpenNodeAt(AT_FDCWD, config_path, config_path);
  } catch (const Error& e) {
    throw Error(ErrorKind::kConfig, config_path, std::string("cannot open config file: ") + e.what());
  }
  return ReadConfigNode(node, config_path);
}

ModelSpec BuildModelSpec(const std::string& config_path, const SpecOptions& options) {
  return BuildModelSpecFromJson(config_path, ReadConfigFile(config_path), options);
}

// config.json of a checkpoint directory resolves beneath its root like the checkpoint's files.
std::optional<std::string> ReadCheckpointConfig(const std::string& checkpoint) {
  struct stat st;
  if (stat(checkpoint.c_str(), &st) != 0) return std::nullopt;
  const std::string dir = S_ISDIR(st.st_mode) ? checkpoint
                          : checkpoint.find('/') == std::string::npos ? std::string(".")
                                                                      : checkpoint.substr(0, checkpoint.rfind('/'));
  std::optional<OpenNode> node = OpenCheckpointName(dir, "config.json");
  if (!node) return std::nullopt;
  return ReadConfigNode(node, dir + "/config.json");
}

std::optional<BlockSize> ConfigWeightBlockSize(std::string_view source, std::string_view config_json) {
  const nlohmann::json j = nlohmann::json::parse(config_json, nullptr, /*allow_exceptions=*/false);
  if (!j.is_object() || !j.contains("quantization_config") || !j["quantization_config"].is_object()) return std::nullopt;
  const auto& q = j["quantization_config"];
  if (!q.contains("weight_block_size") || q["weight_block_size"].is_null()) return std::nullopt;
  const auto& b = q["weight_block_size"];
  if (!b.is_array() || b.size() != 2 || !b[0].is_number_unsigned() || !b[1].is_number_unsigned() ||
      b[0].get<uint64_t>() == 0 || b[1].get<uint64_t>() == 0) {
    throw Error(ErrorKind::kConfig, std::string(source),
                "quantization_config.weight_block_size must be two positive integers, not " + b.dump());
  }
  return BlockSize{b[0].get<uint64_t>(), b[1].get<uint64_t>()};
}

}  // namespace shardcast
