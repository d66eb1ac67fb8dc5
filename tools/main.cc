// The shardcast command line. Each subcommand lives in its own cmd_*.cc.
#include <c10/util/Flags.h>

#include <CLI/CLI.hpp>
#include <cstdlib>
#include <iostream>

C10_DECLARE_int(caffe2_log_level);

#include "tools/cli_util.h"

int main(int argc, char** argv) {
  // c10d logs every closed connection as a warning with a stack trace; our errors already say what
  // happened, once. TORCH_CPP_LOG_LEVEL still wins where a user sets it.
  if (std::getenv("TORCH_CPP_LOG_LEVEL") == nullptr) FLAGS_caffe2_log_level = 2;  // ERROR
  CLI::App app{"shardcast: memory-efficient model materialization for FSDP2"};
  app.require_subcommand(1);
  shardcast::tools::Runner run;
  shardcast::tools::AddInspect(app, &run);
  shardcast::tools::AddSynth(app, &run);
  shardcast::tools::AddPlan(app, &run);
  shardcast::tools::AddPrepare(app, &run);
  shardcast::tools::AddBenchRss(app, &run);
  shardcast::tools::AddLoad(app, &run, std::vector<std::string>(argv, argv + argc));
  shardcast::tools::AddBenchPread(app, &run);
  shardcast::tools::AddConvert(app, &run);
  shardcast::tools::AddBenchScatter(app, &run, std::vector<std::string>(argv, argv + argc));
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    app.exit(e);
    return 2;  // usage errors are bad input, like every other
  }
  return run ? run() : 2;
}
