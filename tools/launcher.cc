#include "tools/launcher.h"

#include <signal.h>
#include <unistd.h>

#include <cstdio>
#include <string>
#include <thread>

#include "allocators/error.h"
#include "tools/subprocess.h"

namespace shardcast::tools {

int LaunchLocalRanks(int nproc, const std::vector<std::string>& argv, std::chrono::milliseconds grace, int nodes) {
  if (nproc < 1) throw Error(ErrorKind::kInvalidArgument, "--nproc", "must be at least 1");
  if (nodes < 1 || nproc % nodes != 0) {
    throw Error(ErrorKind::kInvalidArgument, "--nodes",
                std::to_string(nodes) + " node(s) do not divide " + std::to_string(nproc) + " ranks");
  }
  const int per_node = nproc / nodes;
  // Bound here and handed to rank 0, which hosts the store on it: no other process can take the port
  // between choosing it and binding it.
  LocalListener listener = LocalListener::Open();
  std::vector<Subprocess> ranks;
  for (int r = 0; r < nproc; ++r) {
    SpawnOptions so;
    so.argv = argv;
    so.env = {"RANK=" + std::to_string(r), "WORLD_SIZE=" + std::to_string(nproc),
              "LOCAL_RANK=" + std::to_string(r % per_node), "LOCAL_WORLD_SIZE=" + std::to_string(per_node),
              "GROUP_RANK=" + std::to_string(r / per_node), "MASTER_ADDR=127.0.0.1",
              "MASTER_PORT=" + std::to_string(listener.port())};
    if (r == 0) {
      so.env.push_back("SHARDCAST_LISTEN_FD=" + std::to_string(listener.fd()));
      so.inherit_fds = {listener.fd()};
    }
    ranks.push_back(Subprocess::Spawn(so));
  }
  listener.Close();  // rank 0 holds the port now: it closes with rank 0, so a dead store host refuses connects
  // Once any rank has exited, the others get `grace` to follow (they will within their collective
  // timeout, failure paths included), and are then killed: the launcher never waits forever, even
  // for a rank that is frozen.
  int first_failure = 0, failed_rank = -1, first_exit = -1;
  auto deadline = std::chrono::steady_clock::time_point::max();
  for (size_t live = ranks.size(); live > 0;) {
    live = 0;
    for (size_t r = 0; r < ranks.size(); ++r) {
      if (ranks[r].running()) {
        ++live;
        continue;
      }
      const int code = ranks[r].Wait(std::chrono::milliseconds(0));
      if (first_exit < 0) {
        first_exit = static_cast<int>(r);
        deadline = std::chrono::steady_clock::now() + grace;
      }
      if (code != 0 && failed_rank < 0) first_failure = code, failed_rank = static_cast<int>(r);
    }
    if (live > 0 && std::chrono::steady_clock::now() > deadline) {
      std::fprintf(stderr, "shardcast launcher: rank %d exited %lld ms ago; killing %zu rank(s) still running\n",
                   first_exit, static_cast<long long>(grace.count()), live);
      for (auto& p : ranks) {
        if (p.running()) p.Kill(SIGKILL);
      }
      if (first_failure == 0) first_failure = 1;
      deadline = std::chrono::steady_clock::time_point::max();
    }
    if (live > 0) std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return first_failure;
}

}  // namespace shardcast::tools
