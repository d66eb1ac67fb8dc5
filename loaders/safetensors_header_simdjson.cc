// The fast path of ParseHeader: simdjson's DOM parser and one walk of its tree that builds the Header or
// declines. The contract is in safetensors_header_fast.h. Built only where CMake found simdjson.
#include <cstdint>
#include <memory>
#include <optional>
#include <simdjson.h>
#include <string>
#include <vector>

#include "loaders/dtype.h"
#include "loaders/safetensors_header_fast.h"

namespace shardcast {
namespace {

// One parser a thread, kept for the next header: its buffers grow to the largest header parsed (a few
// times its bytes), so headers under kKeepParserBytes keep theirs and a larger one frees them after.
constexpr size_t kKeepParserBytes = 1 << 20;

simdjson::dom::parser& ThreadParser() {
  thread_local std::unique_ptr<simdjson::dom::parser> parser;
  if (!parser) parser = std::make_unique<simdjson::dom::parser>();
  return *parser;
}

// [n, ...] of non-negative 64-bit integers into `out`; false for anything else.
bool FastDims(simdjson::dom::element value, std::vector<uint64_t>* out) {
  simdjson::dom::array a;
  if (value.get_array().get(a)) return false;
  out->reserve(a.size());
  for (simdjson::dom::element d : a) {
    uint64_t v;
    if (d.get_uint64().get(v)) return false;
    out->push_back(v);
  }
  return true;
}

bool FastTensor(std::string_view key, simdjson::dom::element value, TensorInfo* t) {
  simdjson::dom::object fields;
  if (value.get_object().get(fields)) return false;
  t->key = key;
  int seen = 0;
  for (simdjson::dom::key_value_pair f : fields) {
    const int bit = f.key == "dtype" ? 1 : f.key == "shape" ? 2 : f.key == "data_offsets" ? 4 : 0;
    if (bit == 0) continue;  // unknown fields are ignored, as the reference does
    if (seen & bit) return false;
    seen |= bit;
    if (bit == 1) {
      std::string_view name;
      if (f.value.get_string().get(name)) return false;
      std::optional<DType> d = ParseDType(name);
      if (!d) return false;
      t->dtype = *d;
    } else if (bit == 2) {
      if (!FastDims(f.value, &t->shape)) return false;
    } else {
      std::vector<uint64_t> offsets;
      if (!FastDims(f.value, &offsets) || offsets.size() != 2) return false;
      t->begin = offsets[0];
      t->end = offsets[1];
    }
  }
  return seen == 7;
}

bool FastMetadata(simdjson::dom::element value, Header* h) {
  if (value.is_null()) return true;
  simdjson::dom::object map;
  if (value.get_object().get(map)) return false;
  for (simdjson::dom::key_value_pair kv : map) {
    std::string_view v;
    if (kv.value.get_string().get(v)) return false;
    for (const auto& [k, ignored] : h->metadata) {
      if (k == kv.key) return false;  // a handful of pairs in practice; a long list is declined
    }
    if (h->metadata.size() >= 64) return false;
    h->metadata.emplace_back(std::string(kv.key), std::string(v));
  }
  return true;
}

}  // namespace

bool ParseHeaderFast(std::string_view json, Header* h) {
  simdjson::dom::element doc;
  if (ThreadParser().parse(json.data(), json.size()).get(doc)) return false;
  simdjson::dom::object top;
  if (doc.get_object().get(top)) return false;
  h->tensors.reserve(top.size());
  bool metadata = false;
  for (simdjson::dom::key_value_pair kv : top) {
    if (kv.key == "__metadata__") {
      if (metadata || !FastMetadata(kv.value, h)) return false;
      metadata = true;
      continue;
    }
    h->tensors.emplace_back();
    if (!FastTensor(kv.key, kv.value, &h->tensors.back())) return false;
  }
  return h->BuildIndex();  // false for a duplicate tensor key
}

bool IsValidUtf8Fast(std::string_view s) { return simdjson::validate_utf8(s.data(), s.size()); }

void ReleaseFastParserAfter(size_t json_bytes) {
  if (json_bytes > kKeepParserBytes) ThreadParser() = simdjson::dom::parser();
}

}  // namespace shardcast
