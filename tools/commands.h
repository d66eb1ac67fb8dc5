// tools/commands: the subcommands the `shardcast` command and bench/'s `shardcast-bench` are made of.
// Each Add* adds its subcommand to the app and sets *run to its body when it is chosen.
#pragma once

#include <functional>
#include <map>
#include <string>
#include <vector>

#include "runtime/load.h"

namespace CLI {
class App;
}

namespace shardcast::tools {

using Runner = std::function<int()>;
void AddInspect(CLI::App& app, Runner* run);
void AddSynth(CLI::App& app, Runner* run);
void AddPlan(CLI::App& app, Runner* run);
void AddPrepare(CLI::App& app, Runner* run);
void AddConvert(CLI::App& app, Runner* run);
void AddOptions(CLI::App& app, Runner* run);  // `shardcast options`: the load options' table

// How a rank loads once its communicator and shards exist, for a --source name the load options do not
// have: shardcast-bench adds the full-broadcast baseline this way, so the shipped command has none.
using LoadAlgorithm = std::function<LoadReport(Communicator&, RankState*, const LoadRequest&)>;
void AddLoad(CLI::App& app, Runner* run, const std::vector<std::string>& argv,
             std::map<std::string, LoadAlgorithm> algorithms = {});

// A command's main once its subcommands are added: parse, run the chosen one; exit 2 for a usage error
// (bad input, like every other), else the subcommand's code. Quiets c10d's per-connection warnings
// unless TORCH_CPP_LOG_LEVEL is set.
int RunMain(CLI::App& app, const Runner& run, int argc, char** argv);

}  // namespace shardcast::tools
