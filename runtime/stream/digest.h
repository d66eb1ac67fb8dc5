// runtime/stream/digest: per-entry digests of the bytes each rank holds, built from segments in any order
// and by any number of hashing ranks.
//
// A segment's digest is XXH3-64 of its bytes seeded with its byte offset in the local tensor; an
// entry's digest is the lane-wise sum (two independent 32-bit lanes, each mod 2^32) of its segments'.
// The sum is order-free and splits across ranks: verifiers that each hashed some of a rank's segments
// add their partial tables, and the total equals what the receiving rank computed over all of them.
//
// Thread safety: a table is used by one thread.
#pragma once

#include <cstddef>
#include <cstdint>
#include <unordered_map>
#include <vector>

namespace shardcast {

uint64_t SegmentDigest(const void* data, uint64_t bytes, uint64_t local_offset);
uint64_t CombineDigests(uint64_t a, uint64_t b);  // lane-wise sum mod 2^32

// One column of per-entry digests (a rank's own entries, or the expected ones of one destination).
class DigestColumn {
 public:
  explicit DigestColumn(size_t entries = 0) : values_(entries, 0) {}
  void Add(uint32_t entry, uint64_t digest) { values_[entry] = CombineDigests(values_[entry], digest); }
  void Merge(const std::vector<uint64_t>& other);  // REQUIRES: same size
  std::vector<uint64_t>& values() { return values_; }
  const std::vector<uint64_t>& values() const { return values_; }
  // One digest of the whole column (XXH3-64 over the entries' digests in entry order).
  uint64_t Fold() const;

 private:
  std::vector<uint64_t> values_;
};

// Expected digests per destination rank, allocated only for the ranks this verifier hashes.
class ExpectedDigests {
 public:
  explicit ExpectedDigests(size_t entries = 0) : entries_(entries) {}
  void Add(int dest, uint32_t entry, uint64_t digest) { Column(dest).Add(entry, digest); }
  DigestColumn& Column(int dest);
  const DigestColumn* Find(int dest) const;

 private:
  size_t entries_;
  std::unordered_map<int, DigestColumn> columns_;
};

}  // namespace shardcast
