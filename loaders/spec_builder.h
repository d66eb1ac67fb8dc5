// loaders/spec_builder: internal to loaders/. What architecture builders share: typed reads of config
// fields that name the field on failure, and helpers that append entries in checkpoint key form.
#pragma once

#include <functional>
#include <nlohmann/json.hpp>
#include <string>

#include "loaders/model_spec.h"

namespace shardcast::spec_internal {

class Config {
 public:
  Config(std::string source, const nlohmann::json& j) : source_(std::move(source)), j_(j) {}
  const std::string& source() const { return source_; }
  const nlohmann::json& json() const { return j_; }
  // A field, or its other name (transformers' attribute_map: the published Qwen3-MoE config says
  // num_experts, transformers 5's save_pretrained writes num_local_experts; Mixtral and OLMoE the
  // other way about). Both present with different values is a config error.
  bool Has(const char* field) const { return Present(field) != nullptr; }
  uint64_t Uint(const char* field) const;                  // required, integer >= 0
  uint64_t Uint(const char* field, uint64_t fallback) const;
  bool Bool(const char* field, bool fallback) const;
  std::string String(const char* field, const std::string& fallback) const;
  [[noreturn]] void Fail(const std::string& what) const;

 private:
  const char* Present(const char* field) const;  // the name the json holds it under, or nullptr
  std::string source_;
  const nlohmann::json& j_;
};

// Appends entries in checkpoint key form, applying the config's dtype and fp8 block quantization.
class SpecBuilder {
 public:
  SpecBuilder(const Config& config, ModelSpec* spec);

  void Add(const std::string& key, std::vector<uint64_t> shape, Role role, DType dtype, int layer = -1);
  void Weight(const std::string& key, std::vector<uint64_t> shape, int layer = -1);  // model dtype
  // "<prefix>.weight" [out, in]; fp8 + "<prefix>.weight_scale_inv" sidecar when block-quantized;
  // ModelOpt NVFP4 (U8 [out, in / 2] + weight_scale, weight_scale_2, input_scale sidecars) when the
  // config's quant_algo is NVFP4 and in is a multiple of 16.
  void Linear(const std::string& prefix, uint64_t out, uint64_t in, int layer, bool quantizable = true);
  void Norm(const std::string& prefix, uint64_t n, int layer = -1) { Weight(prefix + ".weight", {n}, layer); }
  void RotaryInvFreq(uint64_t rotary_dim);
  // Embedding, final norm, lm_head (unless tied): the parts every decoder-only LM shares.
  void EmbeddingAndHead(uint64_t vocab, uint64_t hidden);
  // Calls body(layer) for the first `layers` layers, honoring SpecOptions::layers.
  void Layers(const std::function<void(int)>& body);

  DType dtype() const { return dtype_; }
  std::string L(int layer) const { return "model.layers." + std::to_string(layer); }

 private:
  const Config& config_;
  ModelSpec* spec_;
  DType dtype_ = DType::kBF16;
  uint64_t block_out_ = 0, block_in_ = 0;  // 0: not block-quantized
  bool nvfp4_ = false;                     // quantization_config: modelopt, an NVFP4 quant_algo
};

using Builder = void (*)(const Config&, SpecBuilder&);
void BuildLlama(const Config&, SpecBuilder&);
void BuildMixtral(const Config&, SpecBuilder&);
void BuildQwen3Moe(const Config&, SpecBuilder&);
void BuildDeepseekV3(const Config&, SpecBuilder&);
void BuildMinimaxM2(const Config&, SpecBuilder&);

}  // namespace shardcast::spec_internal
