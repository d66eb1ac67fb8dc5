#include "loaders/quant/format.h"

namespace shardcast {

FindStored FindIn(const Checkpoint& ckpt) {
  return [&ckpt](const std::string& key) -> std::optional<StoredTensor> {
    const Checkpoint::Entry* e = ckpt.Find(key);
    if (e == nullptr) return std::nullopt;
    return StoredTensor{e->info->dtype, &e->info->shape};
  };
}

const std::vector<const QuantFormat*>& QuantFormats() {
  static const std::vector<const QuantFormat*> formats = {&kFp8Format, &kMxfp4Format, &kNvfp4Format};
  return formats;
}

QuantMatch DetectQuant(const FindStored& find, const std::string& key) {
  if (!find(key)) return {};
  QuantMatch claim;
  for (const QuantFormat* f : QuantFormats()) {
    QuantMatch m = f->detect(find, key);
    if (m.piece == QuantPiece::kNone) continue;
    if (m.complete) return m;
    if (claim.piece == QuantPiece::kNone) claim = std::move(m);
  }
  return claim;
}

const QuantFormat* QuantFormatNamed(std::string_view name) {
  for (const QuantFormat* f : QuantFormats()) {
    if (f->name == name) return f;
  }
  return nullptr;
}

const QuantFormat* QuantFormatOfPacking(uint8_t packing) {
  for (const QuantFormat* f : QuantFormats()) {
    if (f->packing == packing) return f;
  }
  return nullptr;
}

}  // namespace shardcast
