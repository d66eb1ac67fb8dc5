// shardcast-bench bench-pread DIR [--fresh]: the raw I/O reference for the load benchmark (JSON on stdout).
#include <CLI/CLI.hpp>
#include <cstdio>

#include "bench/baseline_load.h"
#include "bench/commands.h"
#include "tools/cli_util.h"
#include "tools/commands.h"

namespace shardcast::tools {

void AddBenchPread(CLI::App& app, Runner* run) {
  auto dir = std::make_shared<std::string>();
  auto fresh = std::make_shared<bool>(false);
  auto* cmd = app.add_subcommand("bench-pread", "Read every data byte of a checkpoint with pread (I/O reference)");
  cmd->add_option("checkpoint", *dir, "checkpoint directory")->required();
  cmd->add_flag("--fresh", *fresh, "read into fresh memory (first touch zeroes it) rather than one reused buffer");
  cmd->callback([dir, fresh, run] {
    *run = [dir, fresh] {
      return RunCommand("bench-pread", [&] {
        bench::PreadResult r = bench::PreadCheckpoint(*dir, *fresh);
        std::printf("{\"bytes\": %llu, \"seconds\": %.6f, \"gbps\": %.4f}\n", static_cast<unsigned long long>(r.bytes),
                    r.seconds, r.seconds > 0 ? r.bytes / r.seconds / 1e9 : 0.0);
        return 0;
      });
    };
  });
}

}  // namespace shardcast::tools
