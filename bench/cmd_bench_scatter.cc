// shardcast-bench bench-scatter --bytes SIZE [--nproc N] [--chunk-bytes B] [--staging-slots K]
// The communication reference of the load benchmark: rank 0 scatters SIZE bytes (each rank its share)
// into fresh memory on every rank, over the same Gloo communicator a load uses. JSON on rank 0.
#include <CLI/CLI.hpp>
#include <cstdio>

#include "allocators/error.h"
#include "allocators/units.h"
#include "bench/commands.h"
#include "bench/raw_scatter.h"
#include "runtime/comm/c10d_communicator.h"
#include "runtime/load_options.h"
#include "tools/cli_util.h"
#include "tools/commands.h"
#include "tools/launcher.h"
#include "tools/subprocess.h"

namespace shardcast::tools {
namespace {

struct ScatterArgs {
  std::string bytes, chunk, staging_slots;
  int nproc = 0;
  std::vector<std::string> argv;
};

int RunScatter(const ScatterArgs& a) {
  LoadOptionsBuilder b;
  b.FromEnvironment();
  if (!a.chunk.empty()) b.Set(Option::kChunkBytes, a.chunk, "--chunk-bytes");
  if (!a.staging_slots.empty()) b.Set(Option::kStagingSlots, a.staging_slots, "--staging-slots");
  const LoadOptions o = b.Build();
  const uint64_t total = ParseBytes(a.bytes, "--bytes");
  if (a.nproc > 0) {
    std::vector<std::string> argv = {SelfExe()};
    for (size_t i = 1; i < a.argv.size(); ++i) {
      if (a.argv[i] == "--nproc") {
        ++i;
        continue;
      }
      argv.push_back(a.argv[i]);
    }
    return LaunchLocalRanks(a.nproc, argv, o.timeout + std::chrono::seconds(10));
  }
  const Rendezvous rv = RendezvousFromEnvironment();
  auto comm = rv.world_size == 1 ? CreateLocalCommunicator() : CreateGlooCommunicator(rv, o.timeout, "bench-scatter");
  const bench::ScatterResult r = bench::RawScatter(*comm, total, o.chunk_bytes, o.staging_slots);
  if (r.checksum != 0) throw Error(ErrorKind::kInternal, "bench-scatter", std::to_string(r.checksum) + " bytes wrong");
  if (rv.rank == 0) {
    std::printf("{\"bytes\": %llu, \"seconds\": %.6f, \"gbps\": %.4f, \"world_size\": %d, \"wrong_bytes\": 0}\n",
                static_cast<unsigned long long>(r.bytes), r.seconds, r.seconds > 0 ? r.bytes / r.seconds / 1e9 : 0.0,
                rv.world_size);
  }
  return 0;
}

}  // namespace

void AddBenchScatter(CLI::App& app, Runner* run, const std::vector<std::string>& argv) {
  auto args = std::make_shared<ScatterArgs>();
  args->argv = argv;
  auto* cmd = app.add_subcommand("bench-scatter", "Scatter bytes from rank 0 into fresh memory (communication reference)");
  cmd->add_option("--bytes", args->bytes, "total bytes, e.g. 8G (each rank receives its share)")->required();
  cmd->add_option("--nproc", args->nproc, "launch N local ranks");
  cmd->add_option("--chunk-bytes", args->chunk, "message size (default 64M, as a load)");
  cmd->add_option("--staging-slots", args->staging_slots, "sends in flight + 1 (default 4, as a load)");
  cmd->callback([args, run] { *run = [args] { return RunCommand("bench-scatter", [&] { return RunScatter(*args); }); }; });
}

}  // namespace shardcast::tools
