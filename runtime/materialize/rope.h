// runtime/materialize/rope: rotary-embedding inv_freq, computed locally on every rank from the model config.
//
// The values follow Hugging Face transformers' modeling_rope_utils op by op in float32, so they agree
// with what a transformers model computes to within 1 ulp. Types: default, linear, dynamic (at init,
// seq_len = max_position_embeddings), llama3, yarn (with its attention scaling). The rotary dim is
// the buffer's length x 2: the spec builder already decided it (head_dim x partial_rotary_factor,
// MiniMax-M2's rotary_dim, DeepSeek's qk_rope_head_dim).
//
// Thread safety: pure. Failure: kConfig naming the config file and the field or rope type.
#pragma once

#include <nlohmann/json_fwd.hpp>
#include <string>
#include <string_view>
#include <vector>

namespace shardcast {

struct RopeInit {
  std::string rope_type;
  std::vector<float> inv_freq;    // rotary_dim / 2 values
  double attention_scaling = 1.0; // YaRN's mscale factor applied to cos/sin; 1.0 for the others
};

RopeInit ComputeRope(const nlohmann::json& config, std::string_view source, size_t rotary_dim);

// The rope types with a rule, sorted.
std::vector<std::string> KnownRopeTypes();

}  // namespace shardcast
