#include "allocators/memory_probe.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>

#include "allocators/error.h"

namespace shardcast {
namespace {

// "VmRSS:\t  1234 kB" -> bytes. Lines absent from a kernel leave the field at 0.
void ParseStatus(const char* text, MemorySnapshot* m) {
  struct Field {
    const char* name;
    uint64_t MemorySnapshot::*slot;
  };
  static const Field fields[] = {
      {"VmRSS:", &MemorySnapshot::vm_rss},       {"VmHWM:", &MemorySnapshot::vm_hwm},
      {"RssAnon:", &MemorySnapshot::rss_anon},   {"RssFile:", &MemorySnapshot::rss_file},
      {"RssShmem:", &MemorySnapshot::rss_shmem}, {"VmSize:", &MemorySnapshot::vm_size},
      {"VmPeak:", &MemorySnapshot::vm_peak},
  };
  for (const char* line = text; line && *line; line = std::strchr(line, '\n')) {
    if (*line == '\n') ++line;
    for (const Field& f : fields) {
      size_t n = std::strlen(f.name);
      if (std::strncmp(line, f.name, n) == 0) m->*f.slot = std::strtoull(line + n, nullptr, 10) * 1024;
    }
  }
}

void Raise(uint64_t v, std::atomic<uint64_t>* peak) {
  uint64_t cur = peak->load(std::memory_order_relaxed);
  while (v > cur && !peak->compare_exchange_weak(cur, v, std::memory_order_relaxed)) {
  }
}

}  // namespace

MemorySnapshot ReadMemory(pid_t pid, const std::string& proc_root) {
  std::string path = proc_root + "/" + (pid == 0 ? std::string("self") : std::to_string(pid)) + "/status";
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw Error(ErrorKind::kIo, path, "cannot read the memory probe: " + ErrnoText(errno));
  char buf[8192];
  ssize_t n = ::read(fd, buf, sizeof(buf) - 1);
  int err = errno;
  ::close(fd);
  if (n <= 0) throw Error(ErrorKind::kIo, path, "cannot read the memory probe: " + ErrnoText(n < 0 ? err : EIO));
  buf[n] = '\0';
  MemorySnapshot m;
  ParseStatus(buf, &m);
  if (m.vm_rss == 0 && m.vm_size == 0) {
    throw Error(ErrorKind::kIo, path, "holds no VmRSS/VmSize lines (a kernel thread, or not Linux /proc)");
  }
  return m;
}

bool ResetPeak() {
  int fd = ::open("/proc/self/clear_refs", O_WRONLY | O_CLOEXEC);
  if (fd < 0) return false;
  bool ok = ::write(fd, "5", 1) == 1;
  ::close(fd);
  return ok;
}

PeakSampler::PeakSampler(pid_t pid, std::chrono::milliseconds interval) : pid_(pid), interval_(interval) {
  Sample();  // throws here, not on the thread, if /proc is unreadable
  thread_ = std::thread([this] {
    while (!stop_.load(std::memory_order_relaxed)) {
      std::this_thread::sleep_for(interval_);
      try {
        Sample();
      } catch (const Error&) {
        return;  // the process is gone; keep what was seen
      }
    }
  });
}

PeakSampler::~PeakSampler() { Stop(); }

void PeakSampler::Sample() {
  MemorySnapshot m = ReadMemory(pid_);
  Raise(m.rss_anon, &anon_);
  Raise(m.rss_file, &file_);
  Raise(m.vm_rss, &rss_);
  Raise(m.vm_size, &size_);
  hwm_.store(m.vm_hwm, std::memory_order_relaxed);
}

MemoryPeaks PeakSampler::Current() const {
  return MemoryPeaks{anon_.load(), file_.load(), rss_.load(), size_.load(), hwm_.load()};
}

MemoryPeaks PeakSampler::Stop() {
  if (thread_.joinable()) {
    stop_.store(true);
    thread_.join();
    try {
      Sample();
    } catch (const Error&) {
    }
  }
  return Current();
}

}  // namespace shardcast
