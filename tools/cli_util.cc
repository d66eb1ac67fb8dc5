#include "tools/cli_util.h"

#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <cstdio>
#include <iostream>

#include "allocators/error.h"

namespace shardcast::tools {

std::string HumanBytes(uint64_t bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double v = static_cast<double>(bytes);
  int u = 0;
  while (v >= 1024 && u < 4) {
    v /= 1024;
    ++u;
  }
  char buf[32];
  std::snprintf(buf, sizeof(buf), u == 0 ? "%.0f %s" : "%.2f %s", v, units[u]);
  return buf;
}

std::string HumanCount(uint64_t n) {
  char buf[32];
  if (n >= 1000000000ull) std::snprintf(buf, sizeof(buf), "%.2f B", n / 1e9);
  else if (n >= 1000000ull) std::snprintf(buf, sizeof(buf), "%.2f M", n / 1e6);
  else std::snprintf(buf, sizeof(buf), "%llu", static_cast<unsigned long long>(n));
  return buf;
}

std::string ShapeText(const std::vector<uint64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

void WriteTextFile(const std::string& path, const std::string& text) {
  // Written beside the target and renamed over it: a reader never sees half a file.
  const std::string tmp = path + ".tmp-" + std::to_string(getpid());
  std::FILE* f = std::fopen(tmp.c_str(), "w");
  if (f == nullptr) throw Error(ErrorKind::kIo, path, "cannot create " + tmp + ": " + ErrnoText(errno));
  bool ok = std::fwrite(text.data(), 1, text.size(), f) == text.size();
  ok &= std::fflush(f) == 0 && fsync(fileno(f)) == 0;
  ok &= std::fclose(f) == 0;
  if (!ok || std::rename(tmp.c_str(), path.c_str()) != 0) {
    const int err = errno;
    std::remove(tmp.c_str());
    throw Error(ErrorKind::kIo, path, "write failed: " + ErrnoText(err));
  }
}

namespace {

// " [rank R/W]" under a launcher (torchrun, SLURM, --nproc), so interleaved lines say whose they are.
std::string RankTag() {
  const char* rank = std::getenv("RANK");
  const char* world = std::getenv("WORLD_SIZE");
  if (rank == nullptr || world == nullptr) {
    rank = std::getenv("SLURM_PROCID");
    world = std::getenv("SLURM_NTASKS");
  }
  if (rank == nullptr || world == nullptr || std::string(world) == "1") return "";
  return std::string(" [rank ") + rank + "/" + world + "]";
}

// The whole message in one write(2): lines of different ranks sharing a terminal never interleave.
void WriteError(const std::string& text) {
  size_t done = 0;
  while (done < text.size()) {
    const ssize_t n = ::write(STDERR_FILENO, text.data() + done, text.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return;
    done += static_cast<size_t>(n);
  }
}

}  // namespace

int RunCommand(const std::string& command, const std::function<int()>& body) {
  const std::string who = "shardcast " + command + RankTag() + ": ";
  try {
    return body();
  } catch (const Error& e) {
    WriteError(who + ErrorKindName(e.kind()) + ": " + e.what() + "\n");
    switch (e.kind()) {
      case ErrorKind::kCheckpoint:
      case ErrorKind::kConfig:
      case ErrorKind::kInvalidArgument:
      case ErrorKind::kManifestMismatch:
      case ErrorKind::kUnsupported:
        return 2;
      default:
        return 1;
    }
  } catch (const std::exception& e) {
    WriteError(who + e.what() + "\n");
    return 1;
  }
}

}  // namespace shardcast::tools
