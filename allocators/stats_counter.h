// allocators/stats_counter: internal. {current, peak, total} updated where the syscall happens.
#pragma once

#include <atomic>

#include "allocators/lazy_zero.h"

namespace shardcast::internal {

class StatsCounter {
 public:
  void Add(uint64_t bytes) {
    uint64_t now = current_.fetch_add(bytes, std::memory_order_relaxed) + bytes;
    uint64_t peak = peak_.load(std::memory_order_relaxed);
    while (now > peak && !peak_.compare_exchange_weak(peak, now, std::memory_order_relaxed)) {
    }
    total_.fetch_add(bytes, std::memory_order_relaxed);
    count_.fetch_add(1, std::memory_order_relaxed);
  }
  void Sub(uint64_t bytes) { current_.fetch_sub(bytes, std::memory_order_relaxed); }
  AllocatorStats Read() const {
    return AllocatorStats{current_.load(), peak_.load(), total_.load(), count_.load()};
  }

 private:
  std::atomic<uint64_t> current_{0}, peak_{0}, total_{0}, count_{0};
};

}  // namespace shardcast::internal
