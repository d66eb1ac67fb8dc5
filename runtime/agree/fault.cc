#include "runtime/agree/fault.h"

#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <optional>
#include <vector>

#include "allocators/error.h"

namespace shardcast {
namespace {

constexpr const char* kPoints[] = {"make",   "group",      "handshake",   "allocate", "stream",
                                   "verify", "save-write", "save-commit", "metadata"};
constexpr const char* kActions[] = {"kill", "stop", "term", "exit", "enomem"};

template <size_t N>
bool OneOf(const std::string& s, const char* const (&names)[N]) {
  for (const char* n : names) {
    if (s == n) return true;
  }
  return false;
}

// A whole decimal number in [min, max], or nullopt.
std::optional<long> Number(const std::string& s, long min, long max) {
  if (s.empty() || s.size() > 9 || s.find_first_not_of("0123456789") != std::string::npos) return std::nullopt;
  const long v = std::atol(s.c_str());
  if (v < min || v > max) return std::nullopt;
  return v;
}

struct Configured {
  FaultSpec spec;
  std::string error;  // a malformed value: thrown by CheckFaultEnvironment and FaultPoint
};

const Configured& FromEnvironment() {
  static const Configured c = [] {
    Configured out;
    try {
      out.spec = ParseFaultSpec(std::getenv(kFaultVariable), std::getenv(kTestFaultsVariable));
    } catch (const Error& e) {
      out.error = e.what();
    }
    if (out.spec.ignored) {
      std::fprintf(stderr, "shardcast: %s is set but ignored: fault injection acts only in tests (%s=1)\n",
                   kFaultVariable, kTestFaultsVariable);
    }
    return out;
  }();
  return c;
}

std::atomic<long> g_passes{0};

}  // namespace

FaultSpec ParseFaultSpec(const char* value, const char* test_switch) {
  FaultSpec out;
  if (value == nullptr || *value == '\0') return out;
  if (test_switch == nullptr || std::string(test_switch) != "1") {
    out.ignored = true;
    return out;
  }
  const std::string s = value;
  auto bad = [&](const std::string& why) {
    throw Error(ErrorKind::kInvalidArgument, std::string(kFaultVariable) + "=\"" + s + "\"",
                why + "; expected RANK:POINT:ACTION[:N], e.g. 1:stream:kill:2");
  };
  std::vector<std::string> parts;
  for (size_t at = 0;;) {
    const size_t colon = s.find(':', at);
    parts.push_back(s.substr(at, colon == std::string::npos ? std::string::npos : colon - at));
    if (colon == std::string::npos) break;
    at = colon + 1;
  }
  if (parts.size() < 3 || parts.size() > 4) bad(std::to_string(parts.size()) + " fields");
  const std::optional<long> rank = Number(parts[0], 0, 1 << 24);
  if (!rank) bad("rank \"" + parts[0] + "\" is not a rank number");
  if (!OneOf(parts[1], kPoints)) {
    bad("point \"" + parts[1] +
        "\" is not make, group, handshake, allocate, stream, verify, save-write, save-commit or metadata");
  }
  if (!OneOf(parts[2], kActions)) bad("action \"" + parts[2] + "\" is not kill, stop, term, exit or enomem");
  const std::optional<long> nth = parts.size() == 4 ? Number(parts[3], 1, 1L << 30) : std::optional<long>(1);
  if (!nth) bad("N \"" + parts[3] + "\" is not a positive count");
  out.armed = true;
  out.rank = static_cast<int>(*rank);
  out.point = parts[1];
  out.action = parts[2];
  out.nth = *nth;
  return out;
}

void CheckFaultEnvironment() {
  const Configured& c = FromEnvironment();
  if (!c.error.empty()) throw Error(ErrorKind::kInvalidArgument, "", c.error);
}

void FaultPoint(const char* point, int rank) {
  const Configured& c = FromEnvironment();
  if (!c.error.empty()) throw Error(ErrorKind::kInvalidArgument, "", c.error);
  const FaultSpec& f = c.spec;
  if (!f.armed || f.rank != rank || f.point != point) return;
  if (g_passes.fetch_add(1) + 1 != f.nth) return;
  const std::string& a = f.action;
  if (a == "kill") raise(SIGKILL);
  if (a == "stop") raise(SIGSTOP);
  if (a == "term") raise(SIGTERM);
  if (a == "exit") _exit(3);
  if (a == "enomem") {
    throw Error(ErrorKind::kIo, "rank " + std::to_string(rank) + " allocation",
                "cannot map memory: " + ErrnoText(ENOMEM) + " (injected by SHARDCAST_FAULT)");
  }
}

}  // namespace shardcast
