// The shardcast command line. Each subcommand lives in its own cmd_*.cc.
#include <CLI/CLI.hpp>
#include <iostream>

#include "tools/cli_util.h"

int main(int argc, char** argv) {
  CLI::App app{"shardcast: memory-efficient model materialization for FSDP2"};
  app.require_subcommand(1);
  shardcast::tools::Runner run;
  shardcast::tools::AddInspect(app, &run);
  shardcast::tools::AddSynth(app, &run);
  shardcast::tools::AddPlan(app, &run);
  shardcast::tools::AddPrepare(app, &run);
  shardcast::tools::AddBenchRss(app, &run);
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
