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

// nodes: split the ranks into this many groups of nproc / nodes consecutive ranks, each with its own
// LOCAL_RANK, LOCAL_WORLD_SIZE and GROUP_RANK (the node index), as torchrun --nnodes gives them on
// separate machines: several "nodes" on one machine, for read-once sources and tests.
int LaunchLocalRanks(int nproc, const std::vector<std::string>& argv, std::chrono::milliseconds grace, int nodes = 1);

}  // namespace shardcast::tools
