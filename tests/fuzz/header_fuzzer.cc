// libFuzzer target: the safetensors header parser on arbitrary file images. Any input must either
// parse or throw shardcast::Error; anything else (crash, sanitizer report, other exception) is a bug.
// ParseHeader's two parsers must also agree: the fast path may only decline what the diagnosing parser
// would decide, never accept more or build another Header.
#include <cstddef>
#include <cstdint>
#include <string>

#include "allocators/error.h"
#include "loaders/safetensors_header.h"

namespace {

std::string Outcome(shardcast::Header (*parse)(std::string_view, std::string_view, uint64_t), std::string_view json,
                    uint64_t file_size) {
  try {
    shardcast::Header h = parse("fuzz.safetensors", json, file_size);
    std::string out = "ok";
    for (const auto& [k, v] : h.metadata) out += "|" + k + "=" + v;
    for (const auto& t : h.tensors) {
      if (t.end > h.data_bytes || t.begin > t.end) __builtin_trap();  // accepted means in bounds
      if (h.Find(t.key) != &t) __builtin_trap();
      out += "|" + t.key + " " + std::to_string(static_cast<int>(t.dtype)) + " " + std::to_string(t.begin) + " " +
             std::to_string(t.end);
      for (uint64_t d : t.shape) out += " " + std::to_string(d);
    }
    return out;
  } catch (const shardcast::Error& e) {
    return std::string("error ") + e.what();
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  uint64_t n = 0;
  try {
    n = shardcast::ParseHeaderLength("fuzz.safetensors", data, size);
  } catch (const shardcast::Error&) {
    return 0;
  }
  const std::string_view json(reinterpret_cast<const char*>(data) + 8, n);
  if (Outcome(&shardcast::ParseHeader, json, size) != Outcome(&shardcast::ParseHeaderDiagnosing, json, size)) {
    __builtin_trap();  // the two parsers disagree
  }
  return 0;
}
