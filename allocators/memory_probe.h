// allocators/memory_probe: what a process holds, read from /proc/<pid>/status.
//
// The kernel keeps a peak only for total RSS (VmHWM). Peaks of anonymous and file-backed memory
// separately come from PeakSampler, which reads the fields every few milliseconds on a thread of
// its own; benchmarks report both. ResetPeak() writes "5" to /proc/self/clear_refs so one process
// can measure several phases; where that is refused it returns false and callers measure each
// phase in a process of its own instead.
//
// Thread safety: free functions are thread-safe; a PeakSampler is used by one thread.
// Failure: ReadMemory throws kIo naming the file when /proc cannot be read.
#pragma once

#include <sys/types.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <string>
#include <thread>

namespace shardcast {

struct MemorySnapshot {  // bytes
  uint64_t vm_rss = 0, vm_hwm = 0, rss_anon = 0, rss_file = 0, rss_shmem = 0, vm_size = 0, vm_peak = 0;
};

// pid 0 means this process. `proc_root` lets tests point at a fake /proc.
MemorySnapshot ReadMemory(pid_t pid = 0, const std::string& proc_root = "/proc");
bool ResetPeak();

struct MemoryPeaks {  // the largest value of each field seen, bytes
  uint64_t rss_anon = 0, rss_file = 0, vm_rss = 0, vm_size = 0;
  uint64_t vm_hwm = 0;  // the kernel's own peak at Stop()
};

class PeakSampler {
 public:
  explicit PeakSampler(pid_t pid = 0, std::chrono::milliseconds interval = std::chrono::milliseconds(2));
  ~PeakSampler();
  PeakSampler(const PeakSampler&) = delete;
  PeakSampler& operator=(const PeakSampler&) = delete;

  MemoryPeaks Stop();  // joins the thread, takes one last reading; idempotent
  MemoryPeaks Current() const;

 private:
  void Sample();
  pid_t pid_;
  std::chrono::milliseconds interval_;
  std::atomic<bool> stop_{false};
  std::atomic<uint64_t> anon_{0}, file_{0}, rss_{0}, size_{0}, hwm_{0};
  std::thread thread_;
};

}  // namespace shardcast
