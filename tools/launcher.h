// tools/launcher: runs N local ranks of a command, the way torchrun's standalone mode does.
//
// Each child gets RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR=127.0.0.1 and
// MASTER_PORT; rank 0 also gets the socket already listening on that port (SHARDCAST_LISTEN_FD), so
// the port cannot be taken in between. Once any child exits, the others get `grace` to exit on their
// own (they will, within their collective timeout) and are then killed, so the launcher never hangs.
// Returns 0 when every rank exited 0, else the first failing rank's exit code.
#pragma once

#include <chrono>
#include <string>
#include <vector>

namespace shardcast::tools {

int LaunchLocalRanks(int nproc, const std::vector<std::string>& argv, std::chrono::milliseconds grace);

}  // namespace shardcast::tools
