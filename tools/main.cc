// The shardcast command line. Each subcommand lives in its own cmd_*.cc; the benchmarks' commands are
// bench/'s shardcast-bench, so this one (the one the wheel ships) holds no benchmark code.
#include <CLI/CLI.hpp>
#include <string>
#include <vector>

#include "tools/cli_util.h"
#include "tools/commands.h"

int main(int argc, char** argv) {
  CLI::App app{"shardcast: memory-efficient model materialization for FSDP2"};
  app.set_version_flag("--version", "shardcast " SHARDCAST_VERSION);  // the same as shardcast.__version__
  shardcast::tools::Runner run;
  shardcast::tools::AddInspect(app, &run);
  shardcast::tools::AddSynth(app, &run);
  shardcast::tools::AddPlan(app, &run);
  shardcast::tools::AddPrepare(app, &run);
  shardcast::tools::AddLoad(app, &run, std::vector<std::string>(argv, argv + argc));
  shardcast::tools::AddConvert(app, &run);
  shardcast::tools::AddOptions(app, &run);
  return shardcast::tools::RunMain(app, run, argc, argv);
}
