// loaders/quantization: which quantized format each checkpoint tensor belongs to, as `shardcast inspect`
// names it, and the check of a config's quantization_config. Pairs are found by key, never by position;
// the formats and their rules are the entries of loaders/quant/format.h:
//
//   fp8 blocks  "<w>" F8_E4M3 / F8_E5M2          + "<w>_scale_inv" (F32, BF16, F16, F8_E8M0 or U8)
//   MXFP4       "<p>_blocks" U8 [..., out, g, 16] + "<p>_scales" U8 / F8_E8M0 [..., out, g]  (gpt-oss)
//   NVFP4       "<w>" U8 [out, in / 2]            + "<m>.weight_scale" F8_E4M3 [out, in / 16]
//                                                 + "<m>.weight_scale_2" F32 (ModelOpt)
//
// QuantOf names a tensor only when its pairing is complete (DetectQuant's `complete`): a weight whose
// partner is missing is "" here, and the reader names what is wrong with it.
// Thread safety: pure functions over an immutable Checkpoint.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "loaders/checkpoint.h"

namespace shardcast {

enum class QuantRole : uint8_t {
  kNone,         // not quantized, not a scale
  kFp8Weight,    // partner: its "_scale_inv"
  kFp8Scale,     // partner: its weight
  kMxfp4Blocks,  // partner: its "_scales"
  kMxfp4Scales,  // partner: its "_blocks"
  kNvfp4Weight,  // partner: its "weight_scale"
  kNvfp4Scale,   // "weight_scale" or "weight_scale_2"; partner: its weight
};

struct TensorQuant {
  QuantRole role = QuantRole::kNone;
  std::string partner;  // the key it pairs with; "" for kNone
};

TensorQuant QuantOf(const Checkpoint& ckpt, std::string_view key);

// "fp8", "fp8 scale", "mxfp4", "mxfp4 scales", "nvfp4", "nvfp4 scale", or "" for kNone.
std::string_view QuantRoleName(QuantRole role);

// A checkpoint config's quantization_config.quant_method, checked before anything is paired: absent,
// or one whose layout shardcast reads by key ("fp8", "mxfp4", "modelopt" with quant_algo "NVFP4" or
// "W4A16_NVFP4"). Anything else (e.g. "bitsandbytes", "gptq", "awq", modelopt's "FP8") is kCheckpoint
// naming `source` and the method: its tensors would otherwise be read as if they held the model's values.
void CheckQuantMethod(std::string_view source, std::string_view config_json);

}  // namespace shardcast
