// shardcast prepare --config FILE --world-size W --rank R [--target cpu] [--dump DIR]
// Materializes one rank as it stands before fully_shard and prints what that cost.
#include <ATen/ATen.h>

#include <CLI/CLI.hpp>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <nlohmann/json.hpp>

#include "allocators/error.h"
#include "allocators/memory_probe.h"
#include "loaders/writer.h"
#include "runtime/materialize/materializer.h"
#include "runtime/materialize/torch_dtype.h"
#include "tools/cli_util.h"
#include "tools/commands.h"

namespace shardcast::tools {
namespace {

struct PrepareArgs {
  std::string config, target = "cpu", dump, json;
  int world_size = 1, rank = 0, layers = -1;
};

// The buffers (computed and persistent) as one safetensors file, to compare with other implementations.
void Dump(const RankState& s, const std::string& dir) {
  std::vector<WriteEntry> entries;
  std::vector<at::Tensor> data;
  for (const LocalTensor& t : s.tensors()) {
    if (t.is_meta()) continue;
    entries.push_back({t.entry->key, t.entry->dtype, t.entry->shape});
    data.push_back(t.tensor.cpu().contiguous());
  }
  DataSource source = [&](const WriteEntry& e, uint64_t off, unsigned char* out, size_t n) {
    for (size_t i = 0; i < entries.size(); ++i) {
      if (entries[i].key == e.key) std::memcpy(out, static_cast<const char*>(data[i].data_ptr()) + off, n);
    }
  };
  WriteCheckpoint(dir, entries, source);
}

int RunPrepare(const PrepareArgs& a) {
  auto target = ParseTarget(a.target);
  if (!target) throw Error(ErrorKind::kInvalidArgument, "--target", "\"" + a.target + "\" is not cpu, pinned or cuda");
  if (a.world_size < 1) {
    throw Error(ErrorKind::kInvalidArgument, "--world-size", "must be at least 1, got " + std::to_string(a.world_size));
  }
  at::empty({1});  // load and initialize libtorch before the baseline
  MemorySnapshot base = ReadMemory();
  bool reset = ResetPeak();
  PeakSampler sampler;
  auto t0 = std::chrono::steady_clock::now();
  ModelSpec spec = BuildModelSpec(a.config, SpecOptions{a.layers});
  const std::string model_type = spec.model_type;
  Plan plan = Plan::Build(std::move(spec), a.world_size);
  PrepareOptions options;
  options.target = *target;
  RankState state = RankState::Prepare(plan, a.rank, options);
  double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  MemoryPeaks peaks = sampler.Stop();
  const PrepareReport& r = state.report();
  Plan::RankBytes bytes = plan.LocalBytes(a.rank);
  auto above = [](uint64_t v, uint64_t b) { return v > b ? v - b : 0; };
  std::printf("prepare: %s rank %d of %d, target %s, %.3f s\n", model_type.c_str(), a.rank, a.world_size,
              TargetName(*target), seconds);
  std::printf("  entries: %zu meta (parameters, sidecars), %zu computed buffers, %zu persistent buffers, "
              "%zu with no rows on this rank\n", r.meta_entries, r.computed_buffers, r.persistent_buffers,
              r.entries_without_rows);
  std::printf("  held now: %s of buffers; the load will add this rank's shard, %s\n", HumanBytes(r.buffer_bytes).c_str(),
              HumanBytes(r.shard_bytes).c_str());
  std::printf("  after the load, by role: parameters %s, persistent buffers %s, non-persistent buffers %s, sidecars %s\n",
              HumanBytes(bytes.by_role[0]).c_str(), HumanBytes(bytes.by_role[1]).c_str(),
              HumanBytes(bytes.by_role[2]).c_str(), HumanBytes(bytes.by_role[3]).c_str());
  std::printf("  peak RssAnon %s, RssFile %s above the baseline after libtorch loaded (%s anon, %s file)%s\n",
              HumanBytes(above(peaks.rss_anon, base.rss_anon)).c_str(), HumanBytes(above(peaks.rss_file, base.rss_file)).c_str(),
              HumanBytes(base.rss_anon).c_str(), HumanBytes(base.rss_file).c_str(),
              reset ? "" : " (peak reset refused: sampled peaks only)");
  for (const auto& note : r.notes) std::printf("  %s\n", note.c_str());
  if (!a.json.empty()) {
    nlohmann::ordered_json j = {{"model_type", model_type}, {"rank", a.rank}, {"world_size", a.world_size},
                                {"target", TargetName(*target)}, {"seconds", seconds},
                                {"peak_rss_anon_above_baseline", above(peaks.rss_anon, base.rss_anon)},
                                {"peak_rss_file_above_baseline", above(peaks.rss_file, base.rss_file)},
                                {"buffer_bytes", r.buffer_bytes}, {"shard_bytes", r.shard_bytes}};
    WriteTextFile(a.json, j.dump(2) + "\n");
  }
  if (!a.dump.empty()) {
    Dump(state, a.dump);
    std::printf("  buffers written to %s/model.safetensors\n", a.dump.c_str());
  }
  return 0;
}

}  // namespace

void AddPrepare(CLI::App& app, Runner* run) {
  auto args = std::make_shared<PrepareArgs>();
  auto* cmd = app.add_subcommand("prepare", "Materialize one rank as before fully_shard and report its memory");
  cmd->add_option("--config", args->config, "HF config.json")->required();
  cmd->add_option("--world-size", args->world_size, "number of ranks")->required();
  cmd->add_option("--rank", args->rank, "this rank")->required();
  cmd->add_option("--target", args->target, "cpu (default), pinned or cuda");
  cmd->add_option("--layers", args->layers, "keep only the first N decoder layers (default: all)")->check(CLI::Range(0, 1 << 30));
  cmd->add_option("--json", args->json, "also write the report as JSON to this file");
  cmd->add_option("--dump", args->dump, "write the materialized buffers to DIR/model.safetensors");
  cmd->callback([args, run] { *run = [args] { return RunCommand("prepare", [&] { return RunPrepare(*args); }); }; });
}

}  // namespace shardcast::tools
