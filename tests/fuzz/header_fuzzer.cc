// libFuzzer target: the safetensors header parser on arbitrary file images. Any input must either
// parse or throw shardcast::Error; anything else (crash, sanitizer report, other exception) is a bug.
#include <cstddef>
#include <cstdint>

#include "allocators/error.h"
#include "loaders/safetensors_header.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  try {
    shardcast::Header h = shardcast::ParseFileImage("fuzz.safetensors", data, size);
    for (const auto& t : h.tensors) {
      if (t.end > h.data_bytes || t.begin > t.end) __builtin_trap();  // accepted means in bounds
    }
  } catch (const shardcast::Error&) {
  }
  return 0;
}
