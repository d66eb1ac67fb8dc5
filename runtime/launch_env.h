// runtime/launch_env: the one parser of the launcher's environment (torchrun's and SLURM's variables),
// behind RendezvousFromEnvironment (communicator.h). Torch-free, so the planning core's tests run it
// under the sanitizers.
//
// SLURM writes task counts per node as a list, in node order, with "(x<n>)" for n consecutive nodes of
// the same count (srun(1), SLURM_TASKS_PER_NODE; SLURM_NTASKS_PER_NODE takes the same form on some
// versions):
//
//   "8"            every node runs 8 tasks
//   "8(x2)"        two nodes of 8
//   "2(x3),1"      nodes 0-2 run 2 tasks, node 3 runs 1
//
// Thread safety: pure functions (RendezvousFromEnvironment reads the environment). Failure:
// kInvalidArgument naming the variable and its value.
#pragma once

#include <string>

namespace shardcast {

// The task count of node `node` (SLURM_NODEID) in a SLURM task list. Throws kInvalidArgument naming
// `name` and `text` for anything else than the form above, and for a node past the list.
int SlurmTasksOnNode(const std::string& name, const std::string& text, int node);

}  // namespace shardcast
