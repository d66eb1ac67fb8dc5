#include "runtime/materialize/rope.h"

#include <cmath>
#include <map>
#include <nlohmann/json.hpp>

#include "allocators/error.h"

namespace shardcast {
namespace {

struct RopeParams {
  std::string source;
  const nlohmann::json* scaling = nullptr;  // rope_parameters / rope_scaling object, or null
  double theta = 10000.0;
  double max_position = 2048;
  size_t dim = 0;
  bool hunyuan = false;  // model_type hunyuan_*: "dynamic" with a fixed alpha is its NTK-alpha RoPE
  double top_original = 0;  // the config's own original_max_position_embeddings (Phi-3 keeps it there), or 0

  [[noreturn]] void Fail(const std::string& what) const { throw Error(ErrorKind::kConfig, source, what); }
  bool Has(const char* k) const { return scaling && scaling->contains(k) && !(*scaling)[k].is_null(); }
  double Number(const char* k) const {
    if (!Has(k)) Fail("rope scaling of type needs field \"" + std::string(k) + "\"");
    if (!(*scaling)[k].is_number()) Fail("rope field \"" + std::string(k) + "\" must be a number");
    return (*scaling)[k].get<double>();
  }
  double Number(const char* k, double fallback) const { return Has(k) ? Number(k) : fallback; }
};

// 1 / base^(2i / dim), as transformers computes it: float32 arange / dim, pow, reciprocal.
std::vector<float> DefaultInvFreq(double base, size_t dim) {
  std::vector<float> out(dim / 2);
  const float fbase = static_cast<float>(base), fdim = static_cast<float>(dim);
  for (size_t i = 0; i < out.size(); ++i) {
    float e = static_cast<float>(2 * i) / fdim;
    out[i] = 1.0f / std::pow(fbase, e);
  }
  return out;
}

RopeInit Default(const RopeParams& p) { return RopeInit{"default", DefaultInvFreq(p.theta, p.dim), 1.0}; }

RopeInit Linear(const RopeParams& p) {
  RopeInit r{"linear", DefaultInvFreq(p.theta, p.dim), 1.0};
  const float factor = static_cast<float>(p.Number("factor"));
  for (float& v : r.inv_freq) v /= factor;
  return r;
}

// Dynamic NTK at init: seq_len = max_position_embeddings, so the base scale is (factor - factor + 1).
// Hunyuan's checkpoints label their NTK-alpha RoPE "dynamic" with a fixed, nonzero "alpha", which
// transformers' Hunyuan models compute as theta * alpha^(dim / (dim - 2)), static.
RopeInit Dynamic(const RopeParams& p) {
  if (p.hunyuan && p.Has("alpha") && p.Number("alpha") != 0) {
    const double d = static_cast<double>(p.dim);
    return RopeInit{"ntk_alpha", DefaultInvFreq(p.theta * std::pow(p.Number("alpha"), d / (d - 2)), p.dim), 1.0};
  }
  const double factor = p.Number("factor");
  const double seq = p.max_position;
  const double d = static_cast<double>(p.dim);
  const double base = p.theta * std::pow((factor * seq / p.max_position) - (factor - 1), d / (d - 2));
  return RopeInit{"dynamic", DefaultInvFreq(base, p.dim), 1.0};
}

RopeInit Llama3(const RopeParams& p) {
  std::vector<float> inv = DefaultInvFreq(p.theta, p.dim);
  const double factor = p.Number("factor"), low = p.Number("low_freq_factor"), high = p.Number("high_freq_factor");
  const double old_ctx = p.Number("original_max_position_embeddings");
  const float low_wavelen = static_cast<float>(old_ctx / low), high_wavelen = static_cast<float>(old_ctx / high);
  const float ff = static_cast<float>(factor), fold = static_cast<float>(old_ctx);
  const float flow = static_cast<float>(low), fspan = static_cast<float>(high - low);
  const float two_pi = static_cast<float>(2 * M_PI);
  for (float& v : inv) {
    const float wavelen = (1.0f / v) * two_pi;  // torch: scalar / tensor is reciprocal(tensor) * scalar
    float llama = wavelen > low_wavelen ? v / ff : v;
    const float smooth = ((1.0f / wavelen) * fold - flow) / fspan;
    const float smoothed = (1.0f - smooth) * llama / ff + smooth * llama;
    const bool medium = !(wavelen < high_wavelen) && !(wavelen > low_wavelen);
    v = medium ? smoothed : llama;
  }
  return RopeInit{"llama3", std::move(inv), 1.0};
}

double YarnMscale(double scale, double mscale) { return scale <= 1 ? 1.0 : 0.1 * mscale * std::log(scale) + 1.0; }

RopeInit Yarn(const RopeParams& p) {
  const double d = static_cast<double>(p.dim);
  const double original = p.Number("original_max_position_embeddings", p.max_position);
  const double factor = p.Has("factor") ? p.Number("factor") : p.max_position / original;
  double attention = 0;
  if (p.Has("attention_factor")) {
    attention = p.Number("attention_factor");
  } else {
    const double mscale = p.Number("mscale", 0), mscale_all_dim = p.Number("mscale_all_dim", 0);
    attention = (mscale != 0 && mscale_all_dim != 0) ? YarnMscale(factor, mscale) / YarnMscale(factor, mscale_all_dim)
                                                     : YarnMscale(factor, 1);
  }
  double beta_fast = p.Number("beta_fast", 0), beta_slow = p.Number("beta_slow", 0);
  if (beta_fast == 0) beta_fast = 32;
  if (beta_slow == 0) beta_slow = 1;
  auto correction_dim = [&](double rotations) {
    return (d * std::log(original / (rotations * 2 * M_PI))) / (2 * std::log(p.theta));
  };
  bool truncate = !(p.scaling && p.scaling->contains("truncate") && (*p.scaling)["truncate"].is_boolean() &&
                    !(*p.scaling)["truncate"].get<bool>());
  double low = correction_dim(beta_fast), high = correction_dim(beta_slow);
  if (truncate) {
    low = std::floor(low);
    high = std::ceil(high);
  }
  low = std::max(low, 0.0);
  high = std::min(high, d - 1);
  if (low == high) high += 0.001;  // transformers' guard against a zero-width ramp

  std::vector<float> inv(p.dim / 2);
  const float fbase = static_cast<float>(p.theta), fdim = static_cast<float>(p.dim);
  const float ffactor = static_cast<float>(factor), flow = static_cast<float>(low);
  const float fspan = static_cast<float>(high - low);
  for (size_t i = 0; i < inv.size(); ++i) {
    const float pos = std::pow(fbase, static_cast<float>(2 * i) / fdim);
    const float extrapolation = 1.0f / pos;
    const float interpolation = 1.0f / (ffactor * pos);
    const float ramp = std::min(1.0f, std::max(0.0f, (static_cast<float>(i) - flow) / fspan));
    const float extrapolation_factor = 1.0f - ramp;
    inv[i] = interpolation * (1.0f - extrapolation_factor) + extrapolation * extrapolation_factor;
  }
  return RopeInit{"yarn", std::move(inv), attention};
}

// LongRoPE (Phi-3 128k, Phi-3.5, Phi-4-mini) at init: no sequence yet, so the short factors, one a
// frequency: 1 / (short_factor[i] * base^(2i / dim)) in float32, as transformers computes it. (Past
// original_max_position_embeddings transformers' forward switches to the long factors itself.)
RopeInit LongRope(const RopeParams& p) {
  if (!p.Has("short_factor") || !(*p.scaling)["short_factor"].is_array()) {
    p.Fail("rope type longrope needs \"short_factor\", a list of numbers");
  }
  const nlohmann::json& factors = (*p.scaling)["short_factor"];
  if (factors.size() != p.dim / 2) {
    p.Fail("rope short_factor has " + std::to_string(factors.size()) + " numbers, but the rotary dim " +
           std::to_string(p.dim) + " needs " + std::to_string(p.dim / 2));
  }
  const double original = p.top_original > 0 ? p.top_original
                                               : p.Number("original_max_position_embeddings", p.max_position);
  const double factor = p.Has("factor") ? p.Number("factor") : p.max_position / original;
  const double attention = p.Has("attention_factor") ? p.Number("attention_factor")
                           : factor <= 1 ? 1.0 : std::sqrt(1 + std::log(factor) / std::log(original));
  std::vector<float> inv(p.dim / 2);
  const float fbase = static_cast<float>(p.theta), fdim = static_cast<float>(p.dim);
  for (size_t i = 0; i < inv.size(); ++i) {
    if (!factors[i].is_number()) p.Fail("rope short_factor must hold numbers");
    const float e = static_cast<float>(2 * i) / fdim;
    inv[i] = 1.0f / (static_cast<float>(factors[i].get<double>()) * std::pow(fbase, e));
  }
  return RopeInit{"longrope", std::move(inv), attention};
}

using RopeRule = RopeInit (*)(const RopeParams&);

const std::map<std::string, RopeRule>& RopeRules() {
  static const std::map<std::string, RopeRule> rules = {
      {"default", Default}, {"linear", Linear}, {"dynamic", Dynamic}, {"llama3", Llama3}, {"yarn", Yarn},
      {"longrope", LongRope}};
  return rules;
}

}  // namespace

std::vector<std::string> KnownRopeTypes() {
  std::vector<std::string> out;
  for (const auto& [k, v] : RopeRules()) out.push_back(k);
  return out;
}

RopeInit ComputeRope(const nlohmann::json& config, std::string_view source, size_t rotary_dim) {
  RopeParams p;
  p.source = std::string(source);
  p.dim = rotary_dim;
  if (rotary_dim < 4 || rotary_dim % 2 != 0) p.Fail("rotary dim must be even and at least 4, got " + std::to_string(rotary_dim));
  // transformers >= 5 writes rope_parameters (with rope_theta inside); older configs rope_scaling.
  for (const char* k : {"rope_parameters", "rope_scaling"}) {
    if (config.contains(k) && config[k].is_object()) {
      p.scaling = &config[k];
      break;
    }
  }
  if (config.contains("rope_theta") && config["rope_theta"].is_number()) p.theta = config["rope_theta"].get<double>();
  else if (p.Has("rope_theta")) p.theta = p.Number("rope_theta");
  if (config.contains("max_position_embeddings") && config["max_position_embeddings"].is_number()) {
    p.max_position = config["max_position_embeddings"].get<double>();
  }
  if (!(p.theta > 0)) p.Fail("rope_theta must be positive");
  if (config.contains("original_max_position_embeddings") && config["original_max_position_embeddings"].is_number()) {
    p.top_original = config["original_max_position_embeddings"].get<double>();
  }
  p.hunyuan = config.contains("model_type") && config["model_type"].is_string() &&
              config["model_type"].get<std::string>().rfind("hunyuan", 0) == 0;
  std::string type = "default";
  for (const char* k : {"rope_type", "type"}) {
    if (p.Has(k) && (*p.scaling)[k].is_string()) {
      type = (*p.scaling)[k].get<std::string>();
      break;
    }
  }
  // Phi-3's configs name LongRoPE "su" (and once "yarn"): transformers' Phi-3 config reads both as longrope.
  const std::string model_type =
      config.contains("model_type") && config["model_type"].is_string() ? config["model_type"].get<std::string>() : "";
  if ((model_type == "phi3" || model_type == "phi4_multimodal") && (type == "su" || type == "yarn")) type = "longrope";
  auto it = RopeRules().find(type);
  if (it == RopeRules().end()) {
    std::string known;
    for (const auto& k : KnownRopeTypes()) known += (known.empty() ? "" : ", ") + k;
    p.Fail("rope type \"" + type + "\" has no init rule (known: " + known + ")");
  }
  return it->second(p);
}

}  // namespace shardcast
