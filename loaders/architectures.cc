// The per-architecture builders: each lists its checkpoint keys in the order the HF model declares
// them. Shapes are [out, in] for linears, as nn.Linear stores them.
#include <algorithm>

#include "loaders/spec_builder.h"

namespace shardcast::spec_internal {
namespace {

struct Dims {
  uint64_t hidden, heads, kv_heads, head_dim, vocab;
};

Dims ReadDims(const Config& c) {
  Dims d;
  d.hidden = c.Uint("hidden_size");
  d.heads = c.Uint("num_attention_heads");
  d.kv_heads = c.Uint("num_key_value_heads", d.heads);
  if (d.heads == 0 || d.hidden % d.heads != 0) {
    if (!c.Has("head_dim")) c.Fail("num_attention_heads must divide hidden_size when head_dim is absent");
  }
  d.head_dim = c.Uint("head_dim", d.heads ? d.hidden / d.heads : 0);
  d.vocab = c.Uint("vocab_size");
  return d;
}

// q/k/v/o projections of grouped-query attention, with optional biases and per-head q/k norms.
void GqaAttention(const Config& c, SpecBuilder& b, const Dims& d, int i, bool bias) {
  const std::string a = b.L(i) + ".self_attn";
  b.Linear(a + ".q_proj", d.heads * d.head_dim, d.hidden, i);
  b.Linear(a + ".k_proj", d.kv_heads * d.head_dim, d.hidden, i);
  b.Linear(a + ".v_proj", d.kv_heads * d.head_dim, d.hidden, i);
  b.Linear(a + ".o_proj", d.hidden, d.heads * d.head_dim, i);
  if (bias) {
    b.Weight(a + ".q_proj.bias", {d.heads * d.head_dim}, i);
    b.Weight(a + ".k_proj.bias", {d.kv_heads * d.head_dim}, i);
    b.Weight(a + ".v_proj.bias", {d.kv_heads * d.head_dim}, i);
    b.Weight(a + ".o_proj.bias", {d.hidden}, i);
  }
}

void LayerNorms(SpecBuilder& b, const Dims& d, int i) {
  b.Norm(b.L(i) + ".input_layernorm", d.hidden, i);
  b.Norm(b.L(i) + ".post_attention_layernorm", d.hidden, i);
}

// gate/up/down projections of a SwiGLU MLP.
void GatedMlp(SpecBuilder& b, const std::string& p, uint64_t hidden, uint64_t inter, int i) {
  b.Linear(p + ".gate_proj", inter, hidden, i);
  b.Linear(p + ".up_proj", inter, hidden, i);
  b.Linear(p + ".down_proj", hidden, inter, i);
}

// Mixtral-style experts: w1 (gate), w2 (down), w3 (up).
void W123Experts(SpecBuilder& b, const std::string& p, uint64_t experts, uint64_t hidden, uint64_t inter, int i) {
  for (uint64_t e = 0; e < experts; ++e) {
    const std::string x = p + ".experts." + std::to_string(e);
    b.Linear(x + ".w1", inter, hidden, i);
    b.Linear(x + ".w2", hidden, inter, i);
    b.Linear(x + ".w3", inter, hidden, i);
  }
}

uint64_t RequirePositive(const Config& c, const char* field) {
  uint64_t v = c.Uint(field);
  if (v == 0) c.Fail("field \"" + std::string(field) + "\" must be positive");
  return v;
}

}  // namespace

void BuildLlama(const Config& c, SpecBuilder& b) {
  Dims d = ReadDims(c);
  uint64_t inter = c.Uint("intermediate_size");
  bool attn_bias = c.Bool("attention_bias", false), mlp_bias = c.Bool("mlp_bias", false);
  b.Weight("model.embed_tokens.weight", {d.vocab, d.hidden});
  b.Layers([&](int i) {
    GqaAttention(c, b, d, i, attn_bias);
    GatedMlp(b, b.L(i) + ".mlp", d.hidden, inter, i);
    if (mlp_bias) {
      for (const char* p : {"gate_proj", "up_proj"}) b.Weight(b.L(i) + ".mlp." + p + ".bias", {inter}, i);
      b.Weight(b.L(i) + ".mlp.down_proj.bias", {d.hidden}, i);
    }
    LayerNorms(b, d, i);
  });
  b.EmbeddingAndHead(d.vocab, d.hidden);
  b.RotaryInvFreq(d.head_dim);
}

void BuildMixtral(const Config& c, SpecBuilder& b) {
  Dims d = ReadDims(c);
  uint64_t inter = c.Uint("intermediate_size"), experts = RequirePositive(c, "num_local_experts");
  b.Weight("model.embed_tokens.weight", {d.vocab, d.hidden});
  b.Layers([&](int i) {
    GqaAttention(c, b, d, i, false);
    const std::string m = b.L(i) + ".block_sparse_moe";
    b.Linear(m + ".gate", experts, d.hidden, i, /*quantizable=*/false);
    W123Experts(b, m, experts, d.hidden, inter, i);
    LayerNorms(b, d, i);
  });
  b.EmbeddingAndHead(d.vocab, d.hidden);
  b.RotaryInvFreq(d.head_dim);
}

void BuildQwen3Moe(const Config& c, SpecBuilder& b) {
  Dims d = ReadDims(c);
  uint64_t inter = c.Uint("intermediate_size"), moe_inter = c.Uint("moe_intermediate_size");
  uint64_t experts = c.Uint("num_experts"), step = c.Uint("decoder_sparse_step", 1);
  std::vector<int> mlp_only;
  if (c.Has("mlp_only_layers")) {
    if (!c.json()["mlp_only_layers"].is_array()) c.Fail("field \"mlp_only_layers\" must be a list of layer indices");
    for (const auto& v : c.json()["mlp_only_layers"]) {
      if (!v.is_number_integer()) c.Fail("field \"mlp_only_layers\" must be a list of layer indices");
      mlp_only.push_back(v.get<int>());
    }
  }
  bool attn_bias = c.Bool("attention_bias", false);
  b.Weight("model.embed_tokens.weight", {d.vocab, d.hidden});
  b.Layers([&](int i) {
    GqaAttention(c, b, d, i, attn_bias);
    b.Norm(b.L(i) + ".self_attn.q_norm", d.head_dim, i);
    b.Norm(b.L(i) + ".self_attn.k_norm", d.head_dim, i);
    bool sparse = std::find(mlp_only.begin(), mlp_only.end(), i) == mlp_only.end() && experts > 0 &&
                  step > 0 && (static_cast<uint64_t>(i) + 1) % step == 0;
    const std::string m = b.L(i) + ".mlp";
    if (sparse) {
      b.Linear(m + ".gate", experts, d.hidden, i, false);
      for (uint64_t e = 0; e < experts; ++e) GatedMlp(b, m + ".experts." + std::to_string(e), d.hidden, moe_inter, i);
    } else {
      GatedMlp(b, m, d.hidden, inter, i);
    }
    LayerNorms(b, d, i);
  });
  b.EmbeddingAndHead(d.vocab, d.hidden);
  b.RotaryInvFreq(d.head_dim);
}

// Multi-head latent attention: low-rank q and kv with a decoupled rope part of qk_rope_head_dim.
void BuildDeepseekV3(const Config& c, SpecBuilder& b) {
  uint64_t hidden = c.Uint("hidden_size"), vocab = c.Uint("vocab_size"), heads = c.Uint("num_attention_heads");
  uint64_t inter = c.Uint("intermediate_size"), moe_inter = c.Uint("moe_intermediate_size");
  uint64_t q_lora = c.Uint("q_lora_rank", 0), kv_lora = c.Uint("kv_lora_rank");
  uint64_t nope = c.Uint("qk_nope_head_dim"), rope = c.Uint("qk_rope_head_dim"), v_dim = c.Uint("v_head_dim");
  uint64_t experts = c.Uint("n_routed_experts", 0), shared = c.Uint("n_shared_experts", 0);
  uint64_t first_dense = c.Uint("first_k_dense_replace", 0), freq = c.Uint("moe_layer_freq", 1);
  b.Weight("model.embed_tokens.weight", {vocab, hidden});
  b.Layers([&](int i) {
    const std::string a = b.L(i) + ".self_attn";
    if (q_lora > 0) {
      b.Linear(a + ".q_a_proj", q_lora, hidden, i);
      b.Norm(a + ".q_a_layernorm", q_lora, i);
      b.Linear(a + ".q_b_proj", heads * (nope + rope), q_lora, i);
    } else {
      b.Linear(a + ".q_proj", heads * (nope + rope), hidden, i);
    }
    b.Linear(a + ".kv_a_proj_with_mqa", kv_lora + rope, hidden, i);
    b.Norm(a + ".kv_a_layernorm", kv_lora, i);
    b.Linear(a + ".kv_b_proj", heads * (nope + v_dim), kv_lora, i);
    b.Linear(a + ".o_proj", hidden, heads * v_dim, i);
    const std::string m = b.L(i) + ".mlp";
    bool moe = experts > 0 && static_cast<uint64_t>(i) >= first_dense && freq > 0 && i % freq == 0;
    if (moe) {
      b.Linear(m + ".gate", experts, hidden, i, false);
      b.Add(m + ".gate.e_score_correction_bias", {experts}, Role::kPersistentBuffer, DType::kF32, i);
      for (uint64_t e = 0; e < experts; ++e) GatedMlp(b, m + ".experts." + std::to_string(e), hidden, moe_inter, i);
      if (shared > 0) GatedMlp(b, m + ".shared_experts", hidden, moe_inter * shared, i);
    } else {
      GatedMlp(b, m, hidden, inter, i);
    }
    b.Norm(b.L(i) + ".input_layernorm", hidden, i);
    b.Norm(b.L(i) + ".post_attention_layernorm", hidden, i);
  });
  b.EmbeddingAndHead(vocab, hidden);
  b.RotaryInvFreq(rope);
}

// GQA with full-width q/k norms ("per_layer") and partial rotary (rotary_dim of head_dim);
// Mixtral-style experts with a sigmoid router and its routing bias.
void BuildMinimaxM2(const Config& c, SpecBuilder& b) {
  Dims d = ReadDims(c);
  uint64_t inter = c.Uint("intermediate_size"), experts = RequirePositive(c, "num_local_experts");
  uint64_t rotary_dim = c.Uint("rotary_dim", d.head_dim);
  bool qk_norm = c.Bool("use_qk_norm", false), routing_bias = c.Bool("use_routing_bias", false);
  std::string norm_type = c.String("qk_norm_type", "per_layer");
  if (qk_norm && norm_type != "per_layer" && norm_type != "per_head") {
    c.Fail("qk_norm_type \"" + norm_type + "\" is neither per_layer nor per_head");
  }
  b.Weight("model.embed_tokens.weight", {d.vocab, d.hidden});
  b.Layers([&](int i) {
    GqaAttention(c, b, d, i, false);
    if (qk_norm) {
      bool per_layer = norm_type == "per_layer";
      b.Norm(b.L(i) + ".self_attn.q_norm", per_layer ? d.heads * d.head_dim : d.head_dim, i);
      b.Norm(b.L(i) + ".self_attn.k_norm", per_layer ? d.kv_heads * d.head_dim : d.head_dim, i);
    }
    const std::string m = b.L(i) + ".block_sparse_moe";
    b.Linear(m + ".gate", experts, d.hidden, i, false);
    if (routing_bias) b.Add(m + ".e_score_correction_bias", {experts}, Role::kPersistentBuffer, DType::kF32, i);
    W123Experts(b, m, experts, d.hidden, inter, i);
    LayerNorms(b, d, i);
  });
  b.EmbeddingAndHead(d.vocab, d.hidden);
  b.RotaryInvFreq(rotary_dim);
}

}  // namespace shardcast::spec_internal
