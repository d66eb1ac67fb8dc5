#include "runtime/materialize/buffer_init.h"

#include <ATen/ATen.h>

#include <cmath>
#include <cstring>
#include <nlohmann/json.hpp>
#include <string_view>

#include "allocators/error.h"
#include "runtime/materialize/rope.h"

namespace shardcast {
namespace {

// The config that holds a rotary buffer's RoPE fields: the model's own; in a composite model whose top level
// has none, its language model's text_config for a buffer under the language model (or any buffer
// outside a vision tower). A vision tower's rotary buffers keep the top level, as before this fallback:
// transformers computes those from vision_config with rules of the tower's own.
const nlohmann::json& RopeConfig(const nlohmann::json& config, const std::string& key) {
  for (const char* k : {"rope_parameters", "rope_scaling", "rope_theta"}) {
    if (config.contains(k)) return config;
  }
  const bool vision = key.find("vision") != std::string::npos || key.find("visual") != std::string::npos;
  if (!vision && config.contains("text_config") && config["text_config"].is_object()) return config["text_config"];
  return config;
}

std::string FillRotary(const BufferInitContext& ctx, const nlohmann::json& config, at::Tensor& out) {
  if (out.dim() != 1 || out.scalar_type() != at::kFloat) {
    throw Error(ErrorKind::kConfig, ctx.source, "buffer '" + ctx.key + "' must be a 1-d float32 tensor for rotary_inv_freq");
  }
  RopeInit r = ComputeRope(config, ctx.source, static_cast<size_t>(out.size(0)) * 2);
  std::memcpy(out.data_ptr<float>(), r.inv_freq.data(), r.inv_freq.size() * sizeof(float));
  char note[96];
  std::snprintf(note, sizeof(note), "%s, attention scaling %.6g", r.rope_type.c_str(), r.attention_scaling);
  return note;
}

std::string RotaryInvFreq(const BufferInitContext& ctx, at::Tensor& out) {
  return FillRotary(ctx, RopeConfig(ctx.config, ctx.key), out);
}

// RoPE per attention type (transformers >= 5: gemma3, olmo3, modernbert, ...): one rotary module holds
// "<type>_inv_freq" and "<type>_original_inv_freq" (the same values) for each type in layer_types, each
// computed from rope_parameters[<type>], as transformers calls its rope init with layer_type=<type>.
std::string LayerTypeRotaryInvFreq(const BufferInitContext& ctx, at::Tensor& out) {
  constexpr std::string_view kModule = "rotary_emb.", kSuffix = "_inv_freq", kOriginal = "_original";
  std::string type = ctx.key.substr(ctx.key.rfind(kModule) + kModule.size());
  type.resize(type.size() - kSuffix.size());
  if (type.size() > kOriginal.size() && type.compare(type.size() - kOriginal.size(), kOriginal.size(), kOriginal) == 0) {
    type.resize(type.size() - kOriginal.size());
  }
  const nlohmann::json& config = RopeConfig(ctx.config, ctx.key);
  const auto params = config.find("rope_parameters");
  if (params == config.end() || !params->is_object() || !params->contains(type) || !(*params)[type].is_object()) {
    throw Error(ErrorKind::kConfig, ctx.source, "buffer '" + ctx.key + "' is the rotary buffer of layer type '" + type +
                "', but the config's rope_parameters has no object for '" + type + "'");
  }
  // The type's own parameters in place of the per-type table. Its rope_theta wins over a top-level one,
  // which stands in where the type has none (transformers' standardization fills it so).
  nlohmann::json view = config;
  view.erase("rope_scaling");
  view["rope_parameters"] = (*params)[type];
  if (view["rope_parameters"].contains("rope_theta")) view.erase("rope_theta");
  // transformers' YaRN reads "truncate" from the per-type table itself, never from the type's entry, so
  // per type it always truncates: the same here, to give its values.
  view["rope_parameters"].erase("truncate");
  return FillRotary(ctx, view, out);
}

// The scaled embedding's factor, kept as a 0-d buffer in the model's dtype (fill_ rounds the double as
// torch.tensor(double) does): sqrt(hidden_size) for the Gemma family (gemma, gemma2, gemma3, vaultgemma,
// t5gemma2, ...), the config's scale_emb for MiniCPM3. Any other model_type with such a buffer is a
// ConfigError naming it (buffer_init gives its value): the buffer's name alone does not say its value.
std::string EmbedScale(const BufferInitContext& ctx, at::Tensor& out) {
  const nlohmann::json* c = &ctx.config;
  if (!c->contains("hidden_size") && c->contains("text_config")) c = &(*c)["text_config"];
  auto type_of = [](const nlohmann::json& j) {
    return j.contains("model_type") && j["model_type"].is_string() ? j["model_type"].get<std::string>() : std::string();
  };
  const std::string type = type_of(*c).empty() ? type_of(ctx.config) : type_of(*c);
  // MiniCPM3's is torch.tensor(scale_emb): int64 for its default (and its hub configs') integer 12
  const bool integral_ok = type == "minicpm3" && at::isIntegralType(out.scalar_type(), /*includeBool=*/false);
  if (out.dim() != 0 || !(at::isFloatingType(out.scalar_type()) || integral_ok)) {
    throw Error(ErrorKind::kConfig, ctx.source, "buffer '" + ctx.key + "' must be a 0-d floating tensor for embed_scale");
  }
  if (type == "minicpm3") {
    const nlohmann::json scale = c->contains("scale_emb") ? (*c)["scale_emb"] : nlohmann::json(12);  // its default
    if (!scale.is_number()) {
      throw Error(ErrorKind::kConfig, ctx.source, "buffer '" + ctx.key + "' needs scale_emb, a number (minicpm3)");
    }
    if (scale.is_number_integer()) {
      out.fill_(scale.get<int64_t>());  // as torch.tensor(int), into the buffer's own dtype
    } else {
      out.fill_(scale.get<double>());
    }
    return "scale_emb " + scale.dump();
  }
  if (type.find("gemma") == std::string::npos) {
    throw Error(ErrorKind::kConfig, ctx.source,
                "buffer '" + ctx.key + "': no rule knows the embedding scale of model_type \"" + type +
                    "\" (sqrt(hidden_size) is Gemma's, scale_emb MiniCPM3's); give it with buffer_init");
  }
  if (!c->contains("hidden_size") || !(*c)["hidden_size"].is_number_unsigned()) {
    throw Error(ErrorKind::kConfig, ctx.source, "buffer '" + ctx.key + "' needs hidden_size, a positive integer");
  }
  const double hidden = static_cast<double>((*c)["hidden_size"].get<uint64_t>());
  out.fill_(std::sqrt(hidden));
  return "sqrt(hidden_size " + std::to_string(static_cast<uint64_t>(hidden)) + ")";
}

}  // namespace

bool GlobMatch(const std::string& pattern, const std::string& text) {
  size_t p = 0, t = 0, star = std::string::npos, mark = 0;
  while (t < text.size()) {
    if (p < pattern.size() && pattern[p] == '*') {
      star = p++;
      mark = t;
    } else if (p < pattern.size() && pattern[p] == text[t]) {
      ++p;
      ++t;
    } else if (star != std::string::npos) {
      p = star + 1;
      t = ++mark;
    } else {
      return false;
    }
  }
  while (p < pattern.size() && pattern[p] == '*') ++p;
  return p == pattern.size();
}

BufferInitRegistry& BufferInitRegistry::Global() {
  static BufferInitRegistry* registry = [] {
    auto* r = new BufferInitRegistry();
    r->Register("rotary_inv_freq", "*rotary_emb.inv_freq", RotaryInvFreq);
    // transformers >= 5 keeps the unscaled-at-init copy that dynamic RoPE resets to: the same values.
    r->Register("rotary_original_inv_freq", "*rotary_emb.original_inv_freq", RotaryInvFreq);
    // after the two above, which "original_inv_freq" must match first
    r->Register("rotary_layer_type_inv_freq", "*rotary_emb.*_inv_freq", LayerTypeRotaryInvFreq);
    r->Register("embed_scale", "*embed_tokens.embed_scale", EmbedScale);
    return r;
  }();
  return *registry;
}

void BufferInitRegistry::Register(std::string rule, std::string key_pattern, BufferInitFn fn) {
  rules_.push_back(Rule{std::move(rule), std::move(key_pattern), std::move(fn)});
}

const BufferInitFn* BufferInitRegistry::Find(const std::string& key, const std::string& rule) const {
  for (const auto& r : rules_) {
    if (rule.empty() ? GlobMatch(r.pattern, key) : r.name == rule) return &r.fn;
  }
  return nullptr;
}

std::string BufferInitRegistry::Run(const BufferInitContext& ctx, const std::string& rule, at::Tensor& out) const {
  const BufferInitFn* fn = Find(ctx.key, rule);
  if (fn == nullptr) {
    throw Error(ErrorKind::kConfig, ctx.key,
                "non-persistent buffer has no init rule" + (rule.empty() ? std::string() : " named \"" + rule + "\"") +
                    "; register one (BufferInitRegistry, or buffer_init= in Python) rather than leave it uninitialized");
  }
  return (*fn)(ctx, out);
}

}  // namespace shardcast
