#include "tools/launcher.h"

#include <signal.h>
#include <unistd.h>

#include <cstdio>
#include <thread>

#include "allocators/error.h"
#include "runtime/subprocess.h"

namespace shardcast::tools {

int LaunchLocalRanks(int nproc, const std::vector<std::string>& argv, std::chrono::milliseconds grace) {
  if (nproc < 1) throw Error(ErrorKind::kInvalidArgument, "--nproc", "must be at least 1");
  const int port = FreeLocalPort();
  std::vector<Subprocess> ranks;
  for (int r = 0; r < nproc; ++r) {
    SpawnOptions so;
    so.argv = argv;
    so.env = {"RANK=" + std::to_string(r), "WORLD_SIZE=" + std::to_string(nproc), "LOCAL_RANK=" + std::to_string(r),
              "LOCAL_WORLD_SIZE=" + std::to_string(nproc), "MASTER_ADDR=127.0.0.1",
              "MASTER_PORT=" + std::to_string(port)};
    ranks.push_back(Subprocess::Spawn(so));
  }
  int first_failure = 0, failed_rank = -1;
  auto deadline = std::chrono::steady_clock::time_point::max();
  for (size_t live = ranks.size(); live > 0;) {
    live = 0;
    for (size_t r = 0; r < ranks.size(); ++r) {
      if (ranks[r].running()) {
        ++live;
        continue;
      }
      int code = ranks[r].Wait(std::chrono::milliseconds(0));
      if (code != 0 && failed_rank < 0) {
        first_failure = code, failed_rank = static_cast<int>(r);
        deadline = std::chrono::steady_clock::now() + grace;
      }
    }
    if (live > 0 && std::chrono::steady_clock::now() > deadline) {
      std::fprintf(stderr, "shardcast launcher: rank %d failed (exit %d); killing %zu rank(s) still running after %lld ms\n",
                   failed_rank, first_failure, live, static_cast<long long>(grace.count()));
      for (auto& p : ranks) p.Kill(SIGKILL);
      deadline = std::chrono::steady_clock::time_point::max();
    }
    if (live > 0) std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return first_failure;
}

}  // namespace shardcast::tools
