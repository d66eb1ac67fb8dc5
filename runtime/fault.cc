#include "runtime/fault.h"

#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <vector>

#include "allocators/error.h"

namespace shardcast {
namespace {

struct Fault {
  bool armed = false;
  int rank = -1;
  std::string point, action;
  long nth = 1;
};

const Fault& Configured() {
  static const Fault f = [] {
    Fault out;
    const char* v = std::getenv("SHARDCAST_FAULT");
    if (v == nullptr || *v == '\0') return out;
    std::vector<std::string> parts;
    const std::string s = v;
    for (size_t at = 0;;) {
      const size_t colon = s.find(':', at);
      parts.push_back(s.substr(at, colon == std::string::npos ? std::string::npos : colon - at));
      if (colon == std::string::npos) break;
      at = colon + 1;
    }
    if (parts.size() < 3 || parts.size() > 4) return out;
    out.rank = std::atoi(parts[0].c_str());
    out.point = parts[1];
    out.action = parts[2];
    out.nth = parts.size() == 4 ? std::max(1L, std::atol(parts[3].c_str())) : 1;
    out.armed = true;
    return out;
  }();
  return f;
}

std::atomic<long> g_passes{0};

}  // namespace

void FaultPoint(const char* point, int rank) {
  const Fault& f = Configured();
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
