// shardcast-bench bench-pread DIR [--fresh] [--nproc N]: the raw I/O reference for the load benchmark (JSON on stdout).
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
  auto nproc = std::make_shared<int>(1);
  auto* cmd = app.add_subcommand("bench-pread", "Read every data byte of a checkpoint with pread (I/O reference)");
  cmd->add_option("checkpoint", *dir, "checkpoint directory")->required();
  cmd->add_flag("--fresh", *fresh, "read into fresh memory (first touch zeroes it) rather than one reused buffer");
  cmd->add_option("--nproc", *nproc, "processes reading together, each its 1/N of the data bytes (default 1)")
      ->check(CLI::Range(1, 1024));
  cmd->callback([dir, fresh, nproc, run] {
    *run = [dir, fresh, nproc] {
      return RunCommand("bench-pread", [&] {
        bench::PreadResult r = bench::PreadCheckpoint(*dir, *fresh, *nproc);
        std::printf("{\"bytes\": %llu, \"nproc\": %d, \"fresh\": %s, \"seconds\": %.6f, \"cpu_seconds\": %.4f, \"gbps\": %.4f}\n",
                    static_cast<unsigned long long>(r.bytes), *nproc, *fresh ? "true" : "false", r.seconds, r.cpu_seconds,
                    r.seconds > 0 ? r.bytes / r.seconds / 1e9 : 0.0);
        return 0;
      });
    };
  });
}

}  // namespace shardcast::tools
