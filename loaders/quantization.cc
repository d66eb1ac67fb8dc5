#include "loaders/quantization.h"

#include <nlohmann/json.hpp>

#include "allocators/error.h"

namespace shardcast {
namespace {

bool EndsWith(std::string_view s, std::string_view suffix) {
  return s.size() > suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

std::string_view Strip(std::string_view s, std::string_view suffix) { return s.substr(0, s.size() - suffix.size()); }

const TensorInfo* Info(const Checkpoint& ckpt, const std::string& key) {
  const Checkpoint::Entry* e = ckpt.Find(key);
  return e ? e->info : nullptr;
}

}  // namespace

TensorQuant QuantOf(const Checkpoint& ckpt, std::string_view key) {
  const TensorInfo* self = Info(ckpt, std::string(key));
  if (self == nullptr) return {};
  if (EndsWith(key, "_scale_inv")) {
    const std::string w(Strip(key, "_scale_inv"));
    if (const TensorInfo* t = Info(ckpt, w); t && IsFp8(t->dtype)) return {QuantRole::kFp8Scale, w};
  }
  if (IsFp8(self->dtype) && Info(ckpt, std::string(key) + "_scale_inv")) {
    return {QuantRole::kFp8Weight, std::string(key) + "_scale_inv"};
  }
  if (EndsWith(key, "_blocks") && self->dtype == DType::kU8) {
    const std::string s = std::string(Strip(key, "_blocks")) + "_scales";
    if (Info(ckpt, s)) return {QuantRole::kMxfp4Blocks, s};
  }
  if (EndsWith(key, "_scales")) {
    const std::string b = std::string(Strip(key, "_scales")) + "_blocks";
    if (const TensorInfo* t = Info(ckpt, b); t && t->dtype == DType::kU8) return {QuantRole::kMxfp4Scales, b};
  }
  for (std::string_view suffix : {".weight_scale_2", ".weight_scale"}) {
    if (!EndsWith(key, suffix)) continue;
    const std::string w = std::string(Strip(key, suffix)) + ".weight";
    if (const TensorInfo* t = Info(ckpt, w); t && t->dtype == DType::kU8) return {QuantRole::kNvfp4Scale, w};
  }
  if (EndsWith(key, ".weight") && self->dtype == DType::kU8) {
    const std::string s = std::string(Strip(key, ".weight")) + ".weight_scale";
    if (const TensorInfo* t = Info(ckpt, s); t && t->dtype == DType::kF8_E4M3) return {QuantRole::kNvfp4Weight, s};
  }
  return {};
}

std::string_view QuantRoleName(QuantRole role) {
  switch (role) {
    case QuantRole::kFp8Weight: return "fp8";
    case QuantRole::kFp8Scale: return "fp8 scale";
    case QuantRole::kMxfp4Blocks: return "mxfp4";
    case QuantRole::kMxfp4Scales: return "mxfp4 scales";
    case QuantRole::kNvfp4Weight: return "nvfp4";
    case QuantRole::kNvfp4Scale: return "nvfp4 scale";
    default: return "";
  }
}

void CheckQuantMethod(std::string_view source, std::string_view config_json) {
  const nlohmann::json j = nlohmann::json::parse(config_json, nullptr, /*allow_exceptions=*/false);
  if (!j.is_object() || !j.contains("quantization_config") || !j["quantization_config"].is_object()) return;
  const auto& q = j["quantization_config"];
  if (!q.contains("quant_method")) return;
  const std::string method = q["quant_method"].is_string() ? q["quant_method"].get<std::string>() : q["quant_method"].dump();
  if (method == "fp8" || method == "mxfp4") return;
  if (method == "modelopt") {  // ModelOpt names its format in quant_algo; shardcast reads the NVFP4 ones
    const std::string algo = q.contains("quant_algo") && q["quant_algo"].is_string() ? q["quant_algo"].get<std::string>()
                             : q.contains("quant_algo")                             ? q["quant_algo"].dump()
                                                                                    : std::string("(none)");
    if (algo == "NVFP4" || algo == "W4A16_NVFP4") return;
    throw Error(ErrorKind::kCheckpoint, std::string(source),
                "quantization_config.quant_algo \"" + algo.substr(0, 64) +
                    "\" of quant_method modelopt is not one shardcast reads (NVFP4, W4A16_NVFP4)");
  }
  throw Error(ErrorKind::kCheckpoint, std::string(source),
              "quantization_config.quant_method \"" + method.substr(0, 64) +
                  "\" is not one shardcast reads (fp8, mxfp4, modelopt): its tensors cannot be loaded as the "
                  "model's values");
}

}  // namespace shardcast
