// shardcast-bench bench-rss --config FILE [--config FILE...] [--strategy zeros-like,empty-like,lazy-zero,meta]
//                     [--world-size W] [--ranks-per-node R] [--layers N] [--json OUT] [--plot OUT.svg]
#include <CLI/CLI.hpp>
#include <cstdlib>
#include <sstream>

#include "allocators/error.h"
#include "bench/rss_bench.h"
#include "bench/commands.h"
#include "tools/cli_util.h"
#include "tools/commands.h"

namespace shardcast::tools {
namespace {

struct BenchRssArgs {
  std::vector<std::string> configs;
  std::string strategies = "zeros-like,empty-like,lazy-zero,meta";
  bench::RssBenchOptions options;
};

int RunBenchRss(BenchRssArgs a) {
  a.options.configs = a.configs;
  a.options.strategies.clear();
  std::stringstream ss(a.strategies);
  std::string name;
  while (std::getline(ss, name, ',')) {
    auto s = bench::ParseRssStrategy(name);
    if (!s) {
      throw Error(ErrorKind::kInvalidArgument, "--strategy",
                  "unknown strategy \"" + name + "\" (zeros-like, empty-like, lazy-zero, meta)");
    }
    a.options.strategies.push_back(*s);
  }
  if (const char* root = std::getenv("SHARDCAST_PROC_ROOT")) a.options.proc_root = root;
  bench::RunRssBench(a.options);
  return 0;
}

}  // namespace

void AddBenchRss(CLI::App& app, Runner* run) {
  auto args = std::make_shared<BenchRssArgs>();
  auto* cmd = app.add_subcommand("bench-rss", "Peak host RSS per rank and per node by materialization strategy");
  cmd->add_option("--config", args->configs, "HF config.json (repeat for several models)")->required();
  cmd->add_option("--strategy", args->strategies, "comma-separated: zeros-like,empty-like,lazy-zero,meta (default: all)");
  cmd->add_option("--world-size", args->options.world_size, "ranks for the shard-after-load column (default 8)");
  cmd->add_option("--ranks-per-node", args->options.ranks_per_node, "processes per case, summed as a node (default 8)");
  cmd->add_option("--layers", args->options.layers, "keep only the first N decoder layers (default: all)");
  cmd->add_option("--json", args->options.json_out, "write the results as JSON");
  cmd->add_option("--plot", args->options.plot_out, "write an SVG plot of node peak RSS against model size");
  cmd->callback([args, run] { *run = [args] { return RunCommand("bench-rss", [&] { return RunBenchRss(*args); }); }; });

  auto child = std::make_shared<std::vector<std::string>>();
  auto* hidden = app.add_subcommand("__rss-child", "")->group("");  // internal: one measured process
  hidden->add_option("args", *child)->expected(3);
  hidden->callback([child, run] {
    *run = [child] {
      return RunCommand("__rss-child", [&] { return bench::RssChildMain((*child)[0], (*child)[1], std::stoi((*child)[2])); });
    };
  });
}

}  // namespace shardcast::tools
