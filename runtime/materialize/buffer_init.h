// runtime/materialize/buffer_init: the registry of init rules for non-persistent buffers.
//
// Non-persistent buffers (RoPE inv_freq) are not in the state dict, so every rank computes them from
// the config; they are never broadcast or left uninitialized. A rule is registered under a name and
// a key pattern ('*' matches any run of characters); a new architecture adds a rule, not a branch.
// Built-in: "rotary_inv_freq" for "*rotary_emb.inv_freq" and "*rotary_emb.original_inv_freq";
// "rotary_layer_type_inv_freq" for "*rotary_emb.<layer type>_inv_freq" (and its "_original_" twin) from
// rope_parameters[<layer type>]; "embed_scale" for Gemma's "*embed_tokens.embed_scale".
//
// Thread safety: Register before concurrent use; Find/Run are then thread-safe.
// Failure: Run throws kConfig naming the key when no rule matches, or the rule's own error.
#pragma once

#include <ATen/core/Tensor.h>

#include <functional>
#include <nlohmann/json_fwd.hpp>
#include <string>
#include <vector>

namespace shardcast {

struct BufferInitContext {
  const nlohmann::json& config;  // the model's config.json
  const std::string& source;     // its path, for messages
  const std::string& key;        // the buffer being filled
};

// Fills `out` (CPU, the buffer's global shape and dtype, zero on entry) and returns a one-line note
// for the report (e.g. "yarn, attention scaling 1.3").
using BufferInitFn = std::function<std::string(const BufferInitContext&, at::Tensor& out)>;

class BufferInitRegistry {
 public:
  static BufferInitRegistry& Global();

  void Register(std::string rule, std::string key_pattern, BufferInitFn fn);
  // By rule name when given, else the first pattern that matches the key; nullptr if none.
  const BufferInitFn* Find(const std::string& key, const std::string& rule) const;
  std::string Run(const BufferInitContext& ctx, const std::string& rule, at::Tensor& out) const;

 private:
  struct Rule {
    std::string name, pattern;
    BufferInitFn fn;
  };
  std::vector<Rule> rules_;
};

bool GlobMatch(const std::string& pattern, const std::string& text);

}  // namespace shardcast
