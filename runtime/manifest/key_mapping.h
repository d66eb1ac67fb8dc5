// runtime/manifest/key_mapping: how model keys name checkpoint tensors (part of the public API: a LoadRequest
// carries one; the manifest resolves every entry through it).
#pragma once

#include <map>
#include <string>
#include <vector>

namespace shardcast {

struct KeyMapping {
  std::string add_prefix;    // default "": checkpoint key = add_prefix + model key
  std::string strip_prefix;  // default "": checkpoint key = model key without this prefix
  std::map<std::string, std::string> tied;  // model key -> model key it shares storage with
  // model key -> checkpoint keys whose elements, concatenated in order, are the entry's: a fused
  // expert tensor [E, 2I, H] is [gate_0, up_0, gate_1, up_1, ...] (transformers 5's MoE layout).
  std::map<std::string, std::vector<std::string>> compose;
};

}  // namespace shardcast
