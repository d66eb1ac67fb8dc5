#include "tools/cli_util.h"

#include <cmath>
#include <cstdio>
#include <iostream>
#include <utility>

#include "allocators/error.h"

namespace shardcast::tools {

uint64_t ParseBytes(const std::string& text) {
  size_t pos = 0;
  double v = 0;
  try {
    v = std::stod(text, &pos);
  } catch (...) {
    throw Error(ErrorKind::kInvalidArgument, "", "\"" + text + "\" is not a byte count");
  }
  std::string unit = text.substr(pos);
  double mult = 1;
  if (unit.empty() || unit == "B") mult = 1;
  else if (unit == "K" || unit == "KiB") mult = 1024.0;
  else if (unit == "M" || unit == "MiB") mult = 1024.0 * 1024;
  else if (unit == "G" || unit == "GiB") mult = 1024.0 * 1024 * 1024;
  else if (unit == "T" || unit == "TiB") mult = 1024.0 * 1024 * 1024 * 1024;
  else if (unit == "KB") mult = 1e3;
  else if (unit == "MB") mult = 1e6;
  else if (unit == "GB") mult = 1e9;
  else if (unit == "TB") mult = 1e12;
  else throw Error(ErrorKind::kInvalidArgument, "", "\"" + text + "\": unknown unit \"" + unit + "\"");
  if (v < 0 || !std::isfinite(v)) throw Error(ErrorKind::kInvalidArgument, "", "\"" + text + "\" is negative");
  return static_cast<uint64_t>(v * mult);
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

namespace {

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
