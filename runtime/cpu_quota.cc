#include "runtime/cpu_quota.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdint>
#include <functional>
#include <vector>

namespace shardcast {
namespace {

constexpr size_t kMaxFileBytes = 64 << 10;
constexpr size_t kMaxDigits = 18;  // below 2^63: no overflow

using ReadQuota = std::function<std::optional<double>(const std::string& directory)>;

// The text of a regular file of at most kMaxFileBytes; none otherwise (absent, a FIFO, a directory, larger).
std::optional<std::string> ReadSmall(const std::string& path) {
  struct stat first;  // before open: opening a device node can act on it, whatever is read
  if (::stat(path.c_str(), &first) != 0 || !S_ISREG(first.st_mode)) return std::nullopt;
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOCTTY);
  if (fd < 0) return std::nullopt;
  struct stat st;
  std::optional<std::string> text;
  if (fstat(fd, &st) == 0 && S_ISREG(st.st_mode)) {  // cgroupfs and procfs files are regular (of size 0)
    text.emplace();
    char buf[4096];
    for (;;) {
      const ssize_t n = ::read(fd, buf, sizeof(buf));
      if (n < 0 && errno == EINTR) continue;
      if (n < 0 || text->size() + static_cast<size_t>(n) > kMaxFileBytes) {
        text.reset();
        break;
      }
      if (n == 0) break;
      text->append(buf, static_cast<size_t>(n));
    }
  }
  ::close(fd);
  return text;
}

std::vector<std::string> Fields(const std::string& text) {
  std::vector<std::string> fields;
  size_t at = 0;
  while ((at = text.find_first_not_of(" \t\n\r\v\f", at)) != std::string::npos) {
    const size_t end = std::min(text.find_first_of(" \t\n\r\v\f", at), text.size());
    fields.push_back(text.substr(at, end - at));
    at = end;
  }
  return fields;
}

// A decimal integer of 1 to kMaxDigits digits; none for anything else (a sign, a point, "max", more digits).
std::optional<int64_t> Count(const std::string& field) {
  if (field.empty() || field.size() > kMaxDigits) return std::nullopt;
  int64_t x = 0;
  for (char c : field) {
    if (c < '0' || c > '9') return std::nullopt;
    x = x * 10 + (c - '0');
  }
  return x;
}

// quota / period, none unless both are positive counts ("max" and -1 are no quota).
std::optional<double> Cpus(const std::string& quota, const std::string& period) {
  const std::optional<int64_t> q = Count(quota), p = Count(period);
  if (!q || !p || *q <= 0 || *p <= 0) return std::nullopt;
  return static_cast<double>(*q) / static_cast<double>(*p);
}

// v2: "QUOTA PERIOD" in cpu.max.
std::optional<double> QuotaV2(const std::string& directory) {
  const std::optional<std::string> text = ReadSmall(directory + "/cpu.max");
  if (!text) return std::nullopt;
  const std::vector<std::string> f = Fields(*text);
  return f.size() < 2 ? std::nullopt : Cpus(f[0], f[1]);
}

// v1: cpu.cfs_quota_us over cpu.cfs_period_us.
std::optional<double> QuotaV1(const std::string& directory) {
  const std::optional<std::string> quota = ReadSmall(directory + "/cpu.cfs_quota_us");
  const std::optional<std::string> period = quota ? ReadSmall(directory + "/cpu.cfs_period_us") : std::nullopt;
  if (!period) return std::nullopt;
  const std::vector<std::string> q = Fields(*quota), p = Fields(*period);
  return q.empty() || p.empty() ? std::nullopt : Cpus(q[0], p[0]);
}

bool IsDirectory(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

std::string NameOf(const std::string& directory) {
  struct stat st;
  if (::stat(directory.c_str(), &st) != 0) return directory;
  return std::to_string(static_cast<unsigned long long>(st.st_ino));
}

// The cgroup path of a /proc line as components below the mount: "/kubepods/pod1/" is {kubepods, pod1},
// "/" is {}. None for ".." (the kernel's way of naming a cgroup outside this namespace's root) and NUL.
std::optional<std::vector<std::string>> Components(const std::string& path) {
  if (path.find('\0') != std::string::npos) return std::nullopt;
  std::vector<std::string> parts;
  size_t at = 0;
  while (at <= path.size()) {
    const size_t end = std::min(path.find('/', at), path.size());
    std::string part = path.substr(at, end - at);
    if (part == "..") return std::nullopt;
    if (!part.empty() && part != ".") parts.push_back(std::move(part));
    at = end + 1;
  }
  return parts;
}

// The lowest quota of the cgroup `parts` below `mount` and of its parents up to `mount` itself, walked
// upwards, so a tie stays with the deeper cgroup:
//
//   mount/a/b/c   read first; its name is the answer's where no cgroup has a quota
//   mount/a/b
//   mount/a
//   mount         read last
CpuQuota Lowest(const std::string& mount, const std::vector<std::string>& parts, const ReadQuota& read) {
  std::vector<std::string> directories{mount};
  for (const std::string& part : parts) directories.push_back(directories.back() + "/" + part);
  CpuQuota lowest{NameOf(directories.back()), std::nullopt};
  for (auto d = directories.rbegin(); d != directories.rend(); ++d) {
    const std::optional<double> cpus = read(*d);
    if (cpus && (!lowest.cpus || *cpus < *lowest.cpus)) lowest = {NameOf(*d), cpus};
  }
  return lowest;
}

struct ProcLine {
  std::string hierarchy, controllers, path;
};

// "ID:CONTROLLERS:PATH" lines (the path may hold colons); lines with fewer than two colons are skipped.
std::vector<ProcLine> ProcLines(const std::string& text) {
  std::vector<ProcLine> lines;
  size_t at = 0;
  while (at < text.size()) {
    const size_t end = std::min(text.find('\n', at), text.size());
    const size_t c1 = text.find(':', at);
    const size_t c2 = c1 < end ? text.find(':', c1 + 1) : std::string::npos;
    if (c2 < end) {
      lines.push_back({text.substr(at, c1 - at), text.substr(c1 + 1, c2 - c1 - 1), text.substr(c2 + 1, end - c2 - 1)});
    }
    at = end + 1;
  }
  return lines;
}

bool HasCpuController(const std::string& controllers) {
  size_t at = 0;
  while (at <= controllers.size()) {
    const size_t end = std::min(controllers.find(',', at), controllers.size());
    if (controllers.compare(at, end - at, "cpu") == 0) return true;
    at = end + 1;
  }
  return false;
}

}  // namespace

CpuQuota CpuQuotaOf(const std::string& root_path, const std::string& proc) {
  if (proc.find('\0') != std::string::npos || root_path.find('\0') != std::string::npos) return {};
  const std::optional<std::string> text = ReadSmall(proc);
  if (!text) return {};
  std::string root = root_path;
  while (root.size() > 1 && root.back() == '/') root.pop_back();
  struct stat st;
  const bool v2 = ::stat((root + "/cgroup.controllers").c_str(), &st) == 0;  // not a v1 or hybrid hierarchy
  for (const ProcLine& line : ProcLines(*text)) {
    if (v2 && line.hierarchy == "0") {
      const std::optional<std::vector<std::string>> parts = Components(line.path);
      return parts ? Lowest(root, *parts, QuotaV2) : CpuQuota{};
    }
    if (v2 || !HasCpuController(line.controllers)) continue;
    std::vector<std::string> mounts;  // "cpu,cpuacct" mounted as itself, else as "cpu"
    if (line.controllers.find_first_of(std::string("/\0", 2)) == std::string::npos) {
      mounts.push_back(root + "/" + line.controllers);
    }
    mounts.push_back(root + "/cpu");
    for (const std::string& mount : mounts) {
      if (!IsDirectory(mount)) continue;
      const std::optional<std::vector<std::string>> parts = Components(line.path);
      return parts ? Lowest(mount, *parts, QuotaV1) : CpuQuota{};
    }
  }
  return {};
}

int WholeCpus(const CpuQuota& quota, int none) {
  if (!quota.cpus || !(*quota.cpus < static_cast<double>(none))) return none;  // NaN too
  return std::max(1, static_cast<int>(std::floor(*quota.cpus)));
}

}  // namespace shardcast
