// The launcher's environment, parsed once in C++ (runtime/launch_env.h): SLURM's task count lists.
#include "runtime/launch_env.h"

#include <gtest/gtest.h>

#include "runtime/agree/communicator.h"
#include "tests/loaders/test_util.h"

namespace shardcast {
namespace {

TEST(SlurmTasksOnNode, EveryDocumentedFormGivesThisNodesCount) {
  EXPECT_EQ(SlurmTasksOnNode("V", "8", 0), 8);
  EXPECT_EQ(SlurmTasksOnNode("V", "8(x2)", 0), 8);
  EXPECT_EQ(SlurmTasksOnNode("V", "8(x2)", 1), 8);
  for (int node : {0, 1, 2}) EXPECT_EQ(SlurmTasksOnNode("V", "2(x3),1", node), 2) << node;
  EXPECT_EQ(SlurmTasksOnNode("V", "2(x3),1", 3), 1);
  EXPECT_EQ(SlurmTasksOnNode("V", "4,3(x2),8", 2), 3);
  EXPECT_EQ(SlurmTasksOnNode("V", "4,3(x2),8", 3), 8);
}

TEST(SlurmTasksOnNode, AnythingElseIsAnErrorNamingTheVariableAndValue) {
  for (const char* bad : {"", "x", "8(", "8(x", "8(x0)", "8(x2", "8x2", "8,", ",8", "8(x2),", "-1", "8 ", "99999999999"}) {
    const std::string quoted = std::string("\"") + bad + "\"";
    EXPECT_SC_ERROR(SlurmTasksOnNode("SLURM_NTASKS_PER_NODE", bad, 0), ErrorKind::kInvalidArgument,
                    "SLURM_NTASKS_PER_NODE", quoted.c_str());
  }
  EXPECT_SC_ERROR(SlurmTasksOnNode("V", "2(x3),1", 4), ErrorKind::kInvalidArgument, "lists 4 node(s)", "node 4");
}

// Regression: SLURM_NTASKS_PER_NODE="8(x2)" (two nodes of 8, as some SLURM versions write it) was refused
// by C++ as "not a non-negative integer" while Python's launcher parsing took its 8.
TEST(RendezvousFromEnvironment, SlurmTaskListsGiveThisNodesTaskCount) {
  testing::Env env;
  for (const char* v : {"RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "SHARDCAST_LISTEN_FD"}) env.Unset(v);
  env.Set("SLURM_PROCID", "9");
  env.Set("SLURM_NTASKS", "16");
  env.Set("SLURM_LOCALID", "1");
  env.Set("SLURM_NODEID", "1");
  env.Set("SLURM_NTASKS_PER_NODE", "8(x2)");
  Rendezvous rv = RendezvousFromEnvironment();
  EXPECT_EQ(rv.source, "slurm");
  EXPECT_EQ(rv.rank, 9);
  EXPECT_EQ(rv.world_size, 16);
  EXPECT_EQ(rv.local_rank, 1);
  EXPECT_EQ(rv.local_world_size, 8);
  env.Set("SLURM_NTASKS", "7");
  env.Set("SLURM_PROCID", "6");
  env.Set("SLURM_NTASKS_PER_NODE", "2(x3),1");
  env.Set("SLURM_NODEID", "3");
  EXPECT_EQ(RendezvousFromEnvironment().local_world_size, 1);
  env.Set("SLURM_NTASKS_PER_NODE", "8(x2");
  EXPECT_SC_ERROR(RendezvousFromEnvironment(), ErrorKind::kInvalidArgument, "SLURM_NTASKS_PER_NODE", "\"8(x2\"");
  env.Set("SLURM_NTASKS", "1x");
  EXPECT_SC_ERROR(RendezvousFromEnvironment(), ErrorKind::kInvalidArgument, "SLURM_NTASKS", "not a non-negative integer");
}

}  // namespace
}  // namespace shardcast
