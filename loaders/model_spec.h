// loaders/model_spec: the full list of state entries of a model, built from its HF config.json.
//
// A ModelSpec names every entry by its Hugging Face checkpoint key with its global shape, dtype and
// role. Builders are registered per model_type (llama, mixtral, qwen3_moe, deepseek_v3, minimax_m2);
// a new architecture adds a builder, not a branch.
//
// Where the config declares fp8 block quantization (quantization_config.weight_block_size), every
// quantized linear weight is F8_E4M3 and carries a "<name>.weight_scale_inv" F32 sidecar of shape
// ceil(out/bo) x ceil(in/bi).
//
// Failure: kConfig naming the file and the field (missing field, unknown model_type, bad value).
// Thread safety: pure functions.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "loaders/dtype.h"
#include "loaders/quant/dequant.h"

namespace shardcast {

enum class Role {
  kParameter,            // nn.Parameter: stays meta until its shard arrives
  kPersistentBuffer,     // in the state dict: real memory on every rank, filled from the checkpoint
  kNonPersistentBuffer,  // not in the state dict: computed locally on every rank (init_rule)
  kSidecar,              // checkpoint-only companion of a parameter (fp8 weight_scale_inv)
};
std::string_view RoleName(Role role);

struct SpecEntry {
  std::string key;
  std::vector<uint64_t> shape;
  DType dtype = DType::kBF16;
  Role role = Role::kParameter;
  // kNonPersistentBuffer only: the rule's name, e.g. "rotary_inv_freq"; a view of a string that outlives
  // every spec (a literal: a handful of rules, where a std::string in each of 90k entries cost 32 B).
  std::string_view init_rule;
  bool replicated = false;  // declared Replicate (besides 0-dim entries, which always are)
  int layer = -1;           // decoder layer index, or -1 for entries outside the layers

  uint64_t numel() const;
  uint64_t nbytes() const { return numel() * DTypeSize(dtype); }
};

struct ModelSpec {
  std::string source;       // the config file it came from, for messages
  std::string model_type;
  std::string config_json;  // the config as read; init rules read their fields from it
  int num_layers = 0;       // layers in this spec (after SpecOptions::layers)
  int total_layers = 0;     // layers in the config
  bool tie_word_embeddings = false;
  std::vector<SpecEntry> entries;

  uint64_t parameter_count() const;                // numel over kParameter entries
  uint64_t bytes(Role role) const;
  const SpecEntry* Find(std::string_view key) const;
};

struct SpecOptions {
  int layers = -1;  // default -1: every layer. N >= 0 keeps the first N decoder layers.
};

ModelSpec BuildModelSpecFromJson(std::string_view source, std::string_view config_json,
                                 const SpecOptions& options = {});
ModelSpec BuildModelSpec(const std::string& config_path, const SpecOptions& options = {});

class Checkpoint;  // loaders/checkpoint.h

// Every tensor `checkpoint` holds, as it holds it (key, shape, dtype), each a parameter of layer N where its
// key has a stack's ".layers.N." (or ".h.N.", ".layer.N.", ".block.N.", ".blocks.N."; the stacks of an
// encoder-decoder share their numbers): the spec of an architecture with no builder (a model_type KnownModelTypes lacks).
// It knows no computed buffers, no persistent-buffer roles and no quantization sidecars (an fp8 checkpoint
// loads as stored). options.layers keeps the entries of no layer and those of layers below it. `source`
// and `model_type` name it in messages. Throws kCheckpoint for a checkpoint that holds no tensor.
ModelSpec SpecFromCheckpoint(const Checkpoint& checkpoint, std::string source, std::string model_type,
                             const SpecOptions& options = {});

// Whether a config's model_type has a registered builder: false for a config that is not a JSON object or
// names none (BuildModelSpecFromJson then says why).
bool HasBuilderFor(std::string_view config_json);

// A config file's text, read like a checkpoint's files (opened once without blocking on a FIFO, a
// regular file of at most 64 MiB, checked through its descriptor). Throws kConfig naming the path.
std::string ReadConfigFile(const std::string& config_path);
// The config.json beside a checkpoint (in its directory, or beside a single file); nullopt if none.
std::optional<std::string> ReadCheckpointConfig(const std::string& checkpoint);

// quantization_config.weight_block_size ([rows, cols]) of a config; nullopt when it declares none.
// Throws kConfig when it is there but not two positive integers.
std::optional<BlockSize> ConfigWeightBlockSize(std::string_view source, std::string_view config_json);

// The model_types with a registered builder, sorted.
std::vector<std::string> KnownModelTypes();

}  // namespace shardcast
