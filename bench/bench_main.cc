// shardcast-bench: the benchmarks' command line, apart from the shipped `shardcast`.
//   shardcast-bench load ... --source baseline   the full-tensor broadcast algorithm shardcast replaces
//                                                 (every other load option and source as `shardcast load`)
//   shardcast-bench bench-rss | bench-pread | bench-scatter
#include <CLI/CLI.hpp>
#include <string>
#include <vector>

#include "bench/baseline_load.h"
#include "bench/commands.h"
#include "tools/cli_util.h"
#include "tools/commands.h"

int main(int argc, char** argv) {
  using namespace shardcast;
  CLI::App app{"shardcast-bench: shardcast's benchmarks and the baselines they compare against"};
  tools::Runner run;
  tools::AddLoad(app, &run, std::vector<std::string>(argv, argv + argc),
                 {{"baseline", [](Communicator& comm, RankState* state, const LoadRequest& rq) {
                    return bench::BaselineLoad(comm, state, rq.checkpoint);
                  }}});
  tools::AddBenchRss(app, &run);
  tools::AddBenchPread(app, &run);
  tools::AddBenchScatter(app, &run, std::vector<std::string>(argv, argv + argc));
  return tools::RunMain(app, run, argc, argv);
}
