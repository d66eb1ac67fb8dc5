// bench/commands: shardcast-bench's own subcommands (tools/cli_util.h has the shared ones).
#pragma once

#include <string>
#include <vector>

#include "tools/cli_util.h"
#include "tools/commands.h"

namespace shardcast::tools {

void AddBenchRss(CLI::App& app, Runner* run);
void AddBenchPread(CLI::App& app, Runner* run);
void AddBenchScatter(CLI::App& app, Runner* run, const std::vector<std::string>& argv);

}  // namespace shardcast::tools
