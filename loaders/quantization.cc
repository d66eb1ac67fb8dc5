#include "loaders/quantization.h"

#include <nlohmann/json.hpp>

#include "allocators/error.h"
#include "loaders/quant/format.h"

namespace shardcast {
namespace {

// How inspect names each format's pieces: the roles of QuantRole, by format and piece.
struct RoleOf {
  QuantRole role;
  std::string_view format;
  QuantPiece piece;
};
constexpr RoleOf kRoles[] = {
    {QuantRole::kFp8Weight, "fp8", QuantPiece::kData},       {QuantRole::kFp8Scale, "fp8", QuantPiece::kScale},
    {QuantRole::kMxfp4Blocks, "mxfp4", QuantPiece::kData},   {QuantRole::kMxfp4Scales, "mxfp4", QuantPiece::kScale},
    {QuantRole::kNvfp4Weight, "nvfp4", QuantPiece::kData},   {QuantRole::kNvfp4Scale, "nvfp4", QuantPiece::kScale},
};

}  // namespace

TensorQuant QuantOf(const Checkpoint& ckpt, std::string_view key) {
  const QuantMatch m = DetectQuant(FindIn(ckpt), std::string(key));
  if (!m.complete) return {};  // a claim without its partners: the reader names it, inspect does not
  for (const RoleOf& r : kRoles) {
    if (r.format == m.format->name && r.piece == m.piece) return {r.role, m.partner};
  }
  return {};
}

std::string_view QuantRoleName(QuantRole role) {
  for (const RoleOf& r : kRoles) {
    if (r.role != role) continue;
    const QuantFormat* f = QuantFormatNamed(r.format);
    return r.piece == QuantPiece::kData ? f->data_name : f->scale_name;
  }
  return "";
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
