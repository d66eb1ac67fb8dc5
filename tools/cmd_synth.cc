// shardcast synth --config FILE --out DIR [--layers N] [--max-shard-size BYTES] [--seed S] [--sparse] [--bf16-twin]
#include <CLI/CLI.hpp>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <vector>

#include <nlohmann/json.hpp>

#include "loaders/checkpoint.h"
#include "loaders/synth.h"
#include "allocators/units.h"
#include "tools/cli_util.h"
#include "tools/commands.h"

namespace shardcast::tools {
namespace {

namespace fs = std::filesystem;

struct SynthArgs {
  std::string config, out, max_shard = "0";
  int layers = -1;
  uint64_t seed = 0;
  bool sparse = false;
  bool bf16_twin = false;
  bool overwrite = false;
};

// The checkpoint's bytes (the entries a checkpoint stores), as a long double: a config of absurd sizes
// overflows no integer here.
long double CheckpointBytes(const ModelSpec& spec) {
  long double total = 0;
  for (const SpecEntry& e : spec.entries) {
    if (e.role == Role::kNonPersistentBuffer) continue;
    long double n = DTypeSize(e.dtype);
    for (uint64_t d : e.shape) n *= static_cast<long double>(d);
    total += n;
  }
  return total;
}

// A checkpoint that cannot fit where it is written is refused before a byte is written (a config of
// absurd sizes filled the disk), unless --sparse, whose data area is a hole.
void CheckRoom(const ModelSpec& spec, const std::string& out, bool sparse) {
  if (sparse) return;
  const long double need = CheckpointBytes(spec);
  std::error_code ec;
  fs::path at = fs::absolute(out, ec);
  while (!at.empty() && !fs::exists(at, ec) && at != at.parent_path()) at = at.parent_path();
  const fs::space_info room = fs::space(at, ec);
  if (ec) return;  // the file system cannot say: the write says what fails
  if (need > static_cast<long double>(room.available)) {
    throw Error(ErrorKind::kInvalidArgument, out,
                "the checkpoint of " + spec.source + " needs " +
                    (need < 1e18L ? HumanBytes(static_cast<uint64_t>(need)) : std::string("more than an exabyte")) +
                    ", and its file system has " + HumanBytes(room.available) +
                    " free (--layers N writes fewer layers; --sparse writes a hole)");
  }
}

std::vector<fs::path> EarlierModelFiles(const std::string& out) {
  std::vector<fs::path> found;
  std::error_code ec;
  if (!fs::is_directory(out, ec)) return found;
  for (const auto& e : fs::directory_iterator(out, ec)) {
    // a model's own files (what synth writes); an adapter or consolidated.safetensors is not the model's
    const std::string name = e.path().filename();
    if ((IsModelFileName(name) || name == kIndexFileName) && e.is_regular_file(ec)) found.push_back(e.path());
  }
  return found;
}

// The files of an earlier model in `out`, removed (with --overwrite) so that the directory holds exactly
// the one written now: beside an older index and shards, a new model.safetensors was read by transformers
// and the index by readers preferring it. Without --overwrite, a kInvalidArgument naming them.
size_t RemoveEarlierModel(const std::string& out, bool overwrite) {
  const std::vector<fs::path> found = EarlierModelFiles(out);
  if (found.empty()) return 0;
  if (!overwrite) {
    throw Error(ErrorKind::kInvalidArgument, out,
                "holds a model's files already (" + std::to_string(found.size()) + ", e.g. " +
                    found.front().filename().string() + "); pass --overwrite to replace them");
  }
  std::error_code ec;
  size_t n = 0;
  for (const fs::path& f : found) n += fs::remove(f, ec) ? 1 : 0;
  return n;
}

int Synth(const SynthArgs& a) {
  ModelSpec spec = BuildModelSpec(a.config, SpecOptions{a.layers});
  SynthOptions opt;
  opt.seed = a.seed;
  opt.max_shard_bytes = ParseBytes(a.max_shard, "--max-shard-size");
  opt.sparse = a.sparse;
  opt.bf16_twin = a.bf16_twin;
  CheckRoom(spec, a.out, a.sparse);
  if (const size_t n = RemoveEarlierModel(a.out, a.overwrite)) {
    std::printf("synth: removed %zu file(s) of an earlier model in %s\n", n, a.out.c_str());
  }
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
  cmd->add_option("--layers", args->layers, "keep only the first N decoder layers (default: all)")->check(CLI::Range(0, 1 << 30));
  cmd->add_option("--max-shard-size", args->max_shard, "split into files of at most this size, e.g. 2G (default: one file)");
  cmd->add_option("--seed", args->seed, "value seed (default 0)");
  cmd->add_flag("--sparse", args->sparse, "full-size files whose data area is a hole (no disk used)");
  cmd->add_flag("--overwrite", args->overwrite, "replace the model files (model*.safetensors, index) already in DIR");
  cmd->add_flag("--bf16-twin", args->bf16_twin,
                "for an fp8 config: write the same model with its fp8 weights dequantized to BF16, no scales");
  cmd->callback([args, run] { *run = [args] { return RunCommand("synth", [&] { return Synth(*args); }); }; });
}

}  // namespace shardcast::tools
