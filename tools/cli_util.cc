#include "tools/cli_util.h"

#include <cmath>
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
  std::FILE* f = std::fopen(path.c_str(), "w");
  if (f == nullptr) throw Error(ErrorKind::kIo, path, "cannot create");
  bool ok = std::fwrite(text.data(), 1, text.size(), f) == text.size();
  ok &= std::fclose(f) == 0;
  if (!ok) throw Error(ErrorKind::kIo, path, "write failed");
}

int RunCommand(const std::string& command, const std::function<int()>& body) {
  try {
    return body();
  } catch (const Error& e) {
    std::cerr << "shardcast " << command << ": " << ErrorKindName(e.kind()) << ": " << e.what() << "\n";
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
    std::cerr << "shardcast " << command << ": " << e.what() << "\n";
    return 1;
  }
}

}  // namespace shardcast::tools
