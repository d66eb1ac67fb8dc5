// Helpers the fuzz targets share: a scratch directory per process and whole-file writes.
// Header-only; any failure here is the machine's, so it aborts rather than throws.
#pragma once

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>
#include <initializer_list>
#include <vector>

namespace shardcast::fuzz {

[[noreturn]] inline void Die(const char* what, const std::string& path) {
  std::fprintf(stderr, "fuzz harness: %s %s\n", what, path.c_str());
  std::abort();
}

// A directory of this process's own, under $TMPDIR, else /dev/shm (tmpfs: no disk per input), else
// /tmp; removed with its files at exit. `names` lists every file a target may leave in it.
class ScratchDir {
 public:
  ScratchDir(const char* target, std::initializer_list<const char*> names) : names_(names.begin(), names.end()) {
    const char* base = std::getenv("TMPDIR");
    struct stat st;
    std::string root = base && *base ? base : stat("/dev/shm", &st) == 0 && S_ISDIR(st.st_mode) ? "/dev/shm" : "/tmp";
    std::string tmpl = root + "/shardcast-" + target + "-XXXXXX";
    if (mkdtemp(tmpl.data()) == nullptr) Die("cannot create a directory like", tmpl);
    path_ = tmpl;
  }
  ~ScratchDir() {
    Clear();
    rmdir(path_.c_str());
  }
  const std::string& path() const { return path_; }
  std::string operator/(const std::string& name) const { return path_ + "/" + name; }
  void Clear() const {
    for (const std::string& n : names_) unlink((*this / n).c_str());
  }

 private:
  std::string path_;
  std::vector<std::string> names_;
};

inline void WriteWholeFile(const std::string& path, std::string_view bytes) {
  int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (fd < 0) Die("cannot create", path);
  size_t done = 0;
  while (done < bytes.size()) {
    ssize_t n = ::write(fd, bytes.data() + done, bytes.size() - done);
    if (n <= 0) Die("cannot write", path);
    done += static_cast<size_t>(n);
  }
  ::close(fd);
}

// The next `n` bytes of [p, end) as a string_view; fewer if the input ends first.
inline std::string_view Take(const unsigned char*& p, const unsigned char* end, size_t n) {
  size_t k = std::min<size_t>(n, static_cast<size_t>(end - p));
  std::string_view out(reinterpret_cast<const char*>(p), k);
  p += k;
  return out;
}

// A little-endian 16-bit length, or 0 at the end of input.
inline size_t TakeLength16(const unsigned char*& p, const unsigned char* end) {
  size_t v = 0;
  for (int i = 0; i < 2 && p < end; ++i) v |= static_cast<size_t>(*p++) << (8 * i);
  return v;
}

}  // namespace shardcast::fuzz
