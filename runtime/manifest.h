// runtime/manifest: what rank 0 found in the checkpoint for every entry of its plan, in the order
// every rank will use; and each rank's check of it against its own plan.
//
// Resolve (rank 0): every plan entry that comes from the checkpoint (parameters, sidecars, persistent
// buffers) is looked up by key, through the declared mappings (prefix add/strip, tied weights). Keys
// the model does not own (fp8 sidecars of a non-fp8 model, bitsandbytes absmax / quant_map /
// quant_state.*, DeepSeek's MTP layer) are skipped and counted, or rejected when asked; either way they
// never shift anything, because nothing is paired by position.
//
// Check (every rank): same world size, same keys in the same order, same shapes and dtypes as its own
// plan. The first difference is the rank's problem for the verdict.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "loaders/checkpoint.h"
#include "runtime/plan.h"

namespace shardcast {

struct KeyMapping {
  std::string add_prefix;    // default "": checkpoint key = add_prefix + model key
  std::string strip_prefix;  // default "": checkpoint key = model key without this prefix
  std::map<std::string, std::string> tied;  // model key -> model key it shares storage with
  // model key -> checkpoint keys whose elements, concatenated in order, are the entry's: a fused
  // expert tensor [E, 2I, H] is [gate_0, up_0, gate_1, up_1, ...] (transformers 5's MoE layout).
  std::map<std::string, std::vector<std::string>> compose;
};

enum class ExtraKeys {
  kSkip,   // default: count them in the report
  kError,  // a checkpoint key the model does not own is a mismatch
};

// One checkpoint tensor that supplies consecutive elements of an entry.
struct ManifestPart {
  std::string checkpoint_key;
  DType source_dtype = DType::kBF16;  // in the checkpoint
  uint32_t file = 0;                  // index into Manifest::files
  uint64_t offset = 0;                // absolute byte offset of its data in that file
  uint64_t numel = 0;
};

struct ManifestEntry {
  std::string key;             // the model's key
  DType target_dtype = DType::kBF16;  // rank 0's plan
  std::vector<uint64_t> shape;
  Role role = Role::kParameter;
  Placement::Kind placement = Placement::kShard;
  std::vector<ManifestPart> parts;  // one, or several concatenated (KeyMapping::compose)
};

struct Manifest {
  int world_size = 1;
  std::vector<std::string> files;  // paths as rank 0 opened them
  std::vector<ManifestEntry> entries;
  uint64_t skipped = 0;            // checkpoint keys the model does not own
  std::vector<std::string> skipped_examples;  // up to 5

  std::string Serialize() const;
  static Manifest Deserialize(const std::string& bytes);  // throws kComm on a malformed blob
};

// Throws kManifestMismatch / kCheckpoint naming the key, file and both values.
Manifest Resolve(const Plan& plan, const Checkpoint& ckpt, const KeyMapping& mapping, ExtraKeys extra);

// Returns this rank's first difference from rank 0's manifest, or "" when it agrees.
std::string CheckManifest(const Manifest& m, const Plan& plan, int rank, int world_size);

}  // namespace shardcast
