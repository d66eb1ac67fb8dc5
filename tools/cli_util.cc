#include "tools/cli_util.h"

#include <unistd.h>

#include <cerrno>
#include <cctype>
#include <cmath>
#include <cstdlib>
#include <cstdio>
#include <iostream>
#include <utility>

#include "allocators/error.h"

namespace shardcast::tools {

DType ParseFloatDType(const std::string& text, const std::string& origin) {
  if (auto d = shardcast::ParseFloatDType(text)) return *d;
  throw Error(ErrorKind::kInvalidArgument, origin, "\"" + text + "\" is not bf16, f16 or f32");
}

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

// The code point of the valid UTF-8 sequence at s[i] and its length, or length 0 if there is none
// (a stray continuation byte, a truncated or overlong sequence, a surrogate, beyond U+10FFFF).
std::pair<uint32_t, size_t> DecodeUtf8(std::string_view s, size_t i) {
  const auto c = static_cast<unsigned char>(s[i]);
  size_t len;
  uint32_t cp;
  if (c < 0x80) return {c, 1};
  if ((c & 0xE0) == 0xC0) { len = 2; cp = c & 0x1F; }
  else if ((c & 0xF0) == 0xE0) { len = 3; cp = c & 0x0F; }
  else if ((c & 0xF8) == 0xF0) { len = 4; cp = c & 0x07; }
  else return {0, 0};
  if (i + len > s.size()) return {0, 0};
  for (size_t k = 1; k < len; ++k) {
    const auto b = static_cast<unsigned char>(s[i + k]);
    if ((b & 0xC0) != 0x80) return {0, 0};
    cp = (cp << 6) | (b & 0x3F);
  }
  static constexpr uint32_t kMin[5] = {0, 0, 0x80, 0x800, 0x10000};
  if (cp < kMin[len] || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return {0, 0};
  return {cp, len};
}

// Code points that are not C0 or DEL but still change what a terminal shows: C1 controls (0x9B is
// CSI, 0x9D OSC), and those that reorder or break the line around them.
bool IsHiddenControl(uint32_t cp) {
  return (cp >= 0x80 && cp <= 0x9F) || cp == 0x061C || cp == 0x200E || cp == 0x200F ||
         (cp >= 0x2028 && cp <= 0x202E) || (cp >= 0x2066 && cp <= 0x2069);
}

}  // namespace

std::string EscapeForTerminal(std::string_view text) {
  std::string out;
  out.reserve(text.size());
  char buf[8];
  for (size_t i = 0; i < text.size();) {
    const auto c = static_cast<unsigned char>(text[i]);
    if (c >= 0x20 && c < 0x7F) {
      if (c == '\\') out += '\\';
      out += static_cast<char>(c);
      ++i;
      continue;
    }
    if (c < 0x80) {  // C0 and DEL
      if (c == '\n') out += "\\n";
      else if (c == '\t') out += "\\t";
      else if (c == '\r') out += "\\r";
      else {
        std::snprintf(buf, sizeof(buf), "\\x%02x", c);
        out += buf;
      }
      ++i;
      continue;
    }
    auto [cp, len] = DecodeUtf8(text, i);
    if (len == 0) {
      std::snprintf(buf, sizeof(buf), "\\x%02x", c);
      out += buf;
      ++i;
    } else if (IsHiddenControl(cp)) {
      std::snprintf(buf, sizeof(buf), "\\u%04x", static_cast<unsigned>(cp));
      out += buf;
      i += len;
    } else {
      out.append(text.substr(i, len));
      i += len;
    }
  }
  return out;
}

namespace {

// A message's lines kept (a verdict lists each failing rank on its own), everything else in them
// escaped: a key or path from a hostile checkpoint cannot drive the terminal.
std::string EscapeLines(const std::string& text) {
  std::string out;
  for (size_t at = 0;;) {
    const size_t nl = text.find('\n', at);
    out += EscapeForTerminal(std::string_view(text).substr(at, nl == std::string::npos ? std::string::npos : nl - at));
    if (nl == std::string::npos) return out;
    out += '\n';
    at = nl + 1;
  }
}

}  // namespace

int RunCommand(const std::string& command, const std::function<int()>& body) {
  const std::string who = "shardcast " + command + RankTag() + ": ";
  try {
    return body();
  } catch (const Error& e) {
    WriteError(who + ErrorKindName(e.kind()) + ": " + EscapeLines(e.what()) + "\n");
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
    WriteError(who + EscapeLines(e.what()) + "\n");
    return 1;
  }
}

}  // namespace shardcast::tools
