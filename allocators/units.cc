#include "allocators/units.h"

#include <cctype>
#include <utility>

#include "allocators/error.h"

namespace shardcast {
namespace {

[[noreturn]] void Bad(std::string_view origin, std::string_view text, const std::string& why) {
  throw Error(ErrorKind::kInvalidArgument, std::string(origin), "\"" + std::string(text) + "\" " + why);
}

struct Unit {
  const char* name;
  uint64_t scale;
};
constexpr Unit kUnits[] = {{"", 1},           {"B", 1},           {"K", 1ull << 10},  {"KiB", 1ull << 10},
                           {"M", 1ull << 20}, {"MiB", 1ull << 20}, {"G", 1ull << 30},  {"GiB", 1ull << 30},
                           {"T", 1ull << 40}, {"TiB", 1ull << 40}, {"KB", 1000ull},    {"MB", 1000000ull},
                           {"GB", 1000000000ull}, {"TB", 1000000000000ull}};

std::string Limit(uint64_t max) { return "exceeds the limit of " + std::to_string(max); }

}  // namespace

uint64_t ParseBytes(std::string_view text, std::string_view origin, uint64_t max) {
  const char* accepted = "is not a size (e.g. 4096, 64M, 1.5GiB, 2GB)";
  size_t i = 0;
  uint64_t whole = 0;
  bool digits = false;
  for (; i < text.size() && std::isdigit(static_cast<unsigned char>(text[i])); ++i, digits = true) {
    if (whole > (UINT64_MAX - 9) / 10) Bad(origin, text, Limit(max));
    whole = whole * 10 + static_cast<uint64_t>(text[i] - '0');
  }
  // The fraction as numerator / 10^k, at most 9 digits: enough for any unit's precision.
  uint64_t frac = 0, denom = 1;
  if (i < text.size() && text[i] == '.') {
    ++i;
    for (; i < text.size() && std::isdigit(static_cast<unsigned char>(text[i])); ++i, digits = true) {
      if (denom < 1000000000ull) frac = frac * 10 + static_cast<uint64_t>(text[i] - '0'), denom *= 10;
    }
  }
  if (!digits) Bad(origin, text, accepted);
  const std::string_view unit = text.substr(i);
  uint64_t scale = 0;
  for (const Unit& u : kUnits) {
    if (unit == u.name) scale = u.scale;
  }
  if (scale == 0) Bad(origin, text, std::string(accepted) + ": unknown unit \"" + std::string(unit) + "\"");
  if (whole > max / scale) Bad(origin, text, Limit(max));
  const uint64_t value = whole * scale + frac * scale / denom;  // frac < denom <= 1e9, scale <= 2^40: no overflow
  if (value > max) Bad(origin, text, Limit(max));
  return value;
}

uint64_t ParseCount(std::string_view text, std::string_view origin, uint64_t max) {
  if (text.empty()) Bad(origin, text, "is not a non-negative integer");
  uint64_t v = 0;
  for (char c : text) {
    if (!std::isdigit(static_cast<unsigned char>(c))) Bad(origin, text, "is not a non-negative integer");
    const uint64_t d = static_cast<uint64_t>(c - '0');
    if (v > max / 10 || d > max - v * 10) Bad(origin, text, Limit(max));
    v = v * 10 + d;
  }
  return v;
}

bool ParseFlag(std::string_view text, std::string_view origin) {
  std::string t;
  for (char c : text) t += static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  if (t == "1" || t == "true" || t == "yes" || t == "on") return true;
  if (t == "0" || t == "false" || t == "no" || t == "off") return false;
  Bad(origin, text, "is not a boolean (1/0, true/false, yes/no, on/off)");
}

}  // namespace shardcast
