// shardcast synth --config FILE --out DIR [--layers N] [--max-shard-size BYTES] [--seed S] [--sparse] [--bf16-twin]
#include <CLI/CLI.hpp>
#include <chrono>
#include <cstdio>

#include <nlohmann/json.hpp>

#include "loaders/synth.h"
#include "allocators/units.h"
#include "tools/cli_util.h"
#include "tools/commands.h"

namespace shardcast::tools {
namespace {

struct SynthArgs {
  std::string config, out, max_shard = "0";
  int layers = -1;
  uint64_t seed = 0;
  bool sparse = false;
  bool bf16_twin = false;
};

int Synth(const SynthArgs& a) {
  ModelSpec spec = BuildModelSpec(a.config, SpecOptions{a.layers});
  SynthOptions opt;
  opt.seed = a.seed;
  opt.max_shard_bytes = ParseBytes(a.max_shard, "--max-shard-size");
  opt.sparse = a.sparse;
  opt.bf16_twin = a.bf16_twin;
  auto t0 = std::chrono::steady_clock::now();
  WrittenCheckpoint w = WriteSynthCheckpoint(spec, a.out, opt);
  // The config beside the weights, as HF checkpoints ship it (layers as written), so `load` finds it.
  // A bf16 twin's has no quantization_config: it describes the checkpoint written, fp8 weights as BF16.
  nlohmann::json config = nlohmann::json::parse(a.bf16_twin ? MakeBf16Twin(spec).spec.config_json : spec.config_json);
  config["num_hidden_layers"] = spec.num_layers;
  WriteTextFile(a.out + "/config.json", config.dump(2) + "\n");
  double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::printf("synth: %s (%d of %d layers), %s parameters, %llu bytes (%s) in %zu file(s) under %s%s\n",
              spec.model_type.c_str(), spec.num_layers, spec.total_layers, HumanCount(spec.parameter_count()).c_str(),
              static_cast<unsigned long long>(w.total_bytes), HumanBytes(w.total_bytes).c_str(), w.files.size(),
              a.out.c_str(), a.sparse ? " (sparse: data area is a hole)" : "");
  if (a.bf16_twin) std::printf("synth: bf16 twin: fp8 weights written dequantized to BF16, without their scales\n");
  std::printf("synth: %.2f s, %.2f GB/s, seed %llu\n", s, s > 0 ? w.total_bytes / s / 1e9 : 0.0,
              static_cast<unsigned long long>(a.seed));
  return 0;
}

}  // namespace

void AddSynth(CLI::App& app, Runner* run) {
  auto args = std::make_shared<SynthArgs>();
  auto* cmd = app.add_subcommand("synth", "Write a deterministic synthetic checkpoint for a model config");
  cmd->add_option("--config", args->config, "HF config.json")->required();
  cmd->add_option("--out", args->out, "output directory")->required();
  cmd->add_option("--layers", args->layers, "keep only the first N decoder layers (default: all)");
  cmd->add_option("--max-shard-size", args->max_shard, "split into files of at most this size, e.g. 2G (default: one file)");
  cmd->add_option("--seed", args->seed, "value seed (default 0)");
  cmd->add_flag("--sparse", args->sparse, "full-size files whose data area is a hole (no disk used)");
  cmd->add_flag("--bf16-twin", args->bf16_twin,
                "for an fp8 config: write the same model with its fp8 weights dequantized to BF16, no scales");
  cmd->callback([args, run] { *run = [args] { return RunCommand("synth", [&] { return Synth(*args); }); }; });
}

}  // namespace shardcast::tools
