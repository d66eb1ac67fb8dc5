#include "runtime/stream/digest.h"

#include <xxhash.h>

namespace shardcast {

uint64_t SegmentDigest(const void* data, uint64_t bytes, uint64_t local_offset) {
  return XXH3_64bits_withSeed(data, bytes, local_offset);
}

uint64_t CombineDigests(uint64_t a, uint64_t b) {
  const uint64_t lo = (a + b) & 0xffffffffull;
  const uint64_t hi = ((a >> 32) + (b >> 32)) & 0xffffffffull;
  return hi << 32 | lo;
}

uint64_t DigestColumn::Fold() const { return XXH3_64bits(values_.data(), values_.size() * sizeof(uint64_t)); }

void DigestColumn::Merge(const std::vector<uint64_t>& other) {
  for (size_t i = 0; i < values_.size() && i < other.size(); ++i) values_[i] = CombineDigests(values_[i], other[i]);
}

DigestColumn& ExpectedDigests::Column(int dest) {
  auto it = columns_.find(dest);
  if (it == columns_.end()) it = columns_.emplace(dest, DigestColumn(entries_)).first;
  return it->second;
}

const DigestColumn* ExpectedDigests::Find(int dest) const {
  auto it = columns_.find(dest);
  return it == columns_.end() ? nullptr : &it->second;
}

}  // namespace shardcast
