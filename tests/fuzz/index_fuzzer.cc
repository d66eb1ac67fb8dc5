// libFuzzer target: ParseWeightMap on arbitrary index.json bytes. Any input must either parse or
// throw shardcast::Error; anything else (crash, sanitizer report, other exception) is a bug. What is
// accepted must keep the contract: keys unique and sorted, every file name a plain relative path. And
// ParseWeightMap's two parsers agree: the fast one declines, never accepts more or gives other pairs.
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "allocators/error.h"
#include "loaders/checkpoint.h"

namespace {

bool IsPlainRelativeName(std::string_view name) {
  if (name.empty() || name.find('\0') != std::string_view::npos || name[0] == '/') return false;
  size_t start = 0;
  while (start <= name.size()) {
    size_t slash = name.find('/', start);
    if (slash == std::string_view::npos) slash = name.size();
    if (name.substr(start, slash - start) == "..") return false;
    start = slash + 1;
  }
  return true;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view json(reinterpret_cast<const char*>(data), size);
  std::string fast = "error", diagnosing = "error";
  try {
    for (const auto& [k, v] : shardcast::ParseWeightMapDiagnosing("fuzz/model.safetensors.index.json", json)) {
      diagnosing += k + '\0' + v + '\0';
    }
  } catch (const shardcast::Error& e) {
    diagnosing = e.what();
  }
  try {
    auto pairs = shardcast::ParseWeightMap("fuzz/model.safetensors.index.json",
                                           std::string_view(reinterpret_cast<const char*>(data), size));
    for (size_t i = 0; i < pairs.size(); ++i) {
      if (i > 0 && !(pairs[i - 1].first < pairs[i].first)) __builtin_trap();  // sorted, no duplicates
      if (!IsPlainRelativeName(pairs[i].second)) __builtin_trap();
    }
    for (const auto& [k, v] : pairs) fast += k + '\0' + v + '\0';
  } catch (const shardcast::Error& e) {
    fast = e.what();
  }
  if (fast != diagnosing) __builtin_trap();  // the two parsers disagree
  return 0;
}
