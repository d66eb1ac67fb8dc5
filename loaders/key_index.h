// loaders/key_index: a table's entries found by key, where the table owns the keys.
//
// Open addressing over the table's positions: 2 to 4 slots an entry, 4 bytes a slot, and no copy of
// any key. At DeepSeek-V3's scale (92k keys) that is about 1 MB, where a std::unordered_map of views
// costs a 64-byte node and a bucket per key (6 MB), and one of strings the keys again. It holds no
// pointers, so a table copied or moved together with its index stays right. The caller passes
// key_at(i), the key at position i, to both calls; positions must be below 2^32 - 1.
//
//   table:  [0] "b"  [1] "a"  [2] "c"      slots (8, say "a" hashes to 1, "b" to 4, "c" to 4):
//                                          . 1 . . 0 2 . .   ("c" takes the next free slot after 4)
//
// Thread safety: Find is const and safe from any thread; Build is not.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string_view>
#include <vector>

namespace shardcast {

class KeyIndex {
 public:
  static constexpr size_t npos = SIZE_MAX;

  // Indexes positions [0, n). A key there twice keeps its first position; the result is then false.
  template <typename KeyAt>
  bool Build(size_t n, KeyAt&& key_at) {
    size_t slots = 4;
    while (slots < 2 * n) slots *= 2;
    slots_.assign(slots, kFree);
    const size_t mask = slots - 1;
    bool unique = true;
    for (size_t i = 0; i < n; ++i) {
      const std::string_view key = key_at(i);
      size_t s = std::hash<std::string_view>{}(key) & mask;
      for (; slots_[s] != kFree; s = (s + 1) & mask) {
        if (key_at(slots_[s]) == key) break;
      }
      if (slots_[s] != kFree) {
        unique = false;
        continue;
      }
      slots_[s] = static_cast<uint32_t>(i);
    }
    return unique;
  }

  // The position of `key`, or npos.
  template <typename KeyAt>
  size_t Find(std::string_view key, KeyAt&& key_at) const {
    if (slots_.empty()) return npos;
    const size_t mask = slots_.size() - 1;
    for (size_t s = std::hash<std::string_view>{}(key) & mask;; s = (s + 1) & mask) {
      if (slots_[s] == kFree) return npos;
      if (key_at(slots_[s]) == key) return slots_[s];
    }
  }

 private:
  static constexpr uint32_t kFree = UINT32_MAX;
  std::vector<uint32_t> slots_;
};

}  // namespace shardcast
