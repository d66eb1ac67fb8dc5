// shardcast load --checkpoint DIR [--config FILE] [--nproc N] [--source auto|rank0|each-rank|node-leader|striped]
//                [--target cpu|pinned|cuda] [--chunk-bytes B] [--staging-slots K] [--verify] [--json OUT]
// With --nproc it launches N local ranks of itself; under torchrun or SLURM it runs as the given rank.
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <chrono>
#include <nlohmann/json.hpp>
#include <cstdio>
#include <map>
#include <optional>

#include "allocators/error.h"
#include "loaders/checkpoint.h"
#include "loaders/model_spec.h"
#include "loaders/synth.h"
#include "runtime/layout/parallel_plan.h"
#include "runtime/load.h"
#include "tools/cli_util.h"
#include "tools/commands.h"
#include "tools/launcher.h"
#include "tools/subprocess.h"

namespace shardcast::tools {
namespace {

struct LoadArgs {
  std::map<std::string, LoadAlgorithm> algorithms;  // --source names beyond the load options' own
  std::string checkpoint, config, json, backend = "gloo", dtype;
  // Load options as given, by OptionTable()'s flags (absent or empty: not given), parsed by
  // LoadOptionsBuilder with the environment; switches (--verify) given when true.
  std::map<Option, std::string> given;
  std::map<Option, bool> switches;
  int nproc = 0, layers = -1, nodes = 1, replicas = 1, tp = 1;
  bool checksum_only = false, quiet = false, setup_only = false;
  std::vector<std::string> argv;  // as given, for the launcher
};

// The one way a load's options are made: the environment, then the flags given (which win).
LoadOptions BuildOptions(const LoadArgs& a) {
  LoadOptionsBuilder b;
  b.FromEnvironment();
  for (const auto& [option, text] : a.given) {
    if (!text.empty()) b.Set(option, text, InfoOf(option).flag);
  }
  for (const auto& [option, on] : a.switches) {
    if (on) b.Set(option, "1", InfoOf(option).flag);
  }
  return b.Build();
}

// Rank 0's progress: a live bar on a TTY, a line every few seconds otherwise.
class ProgressPrinter {
 public:
  ProgressPrinter() : tty_(isatty(STDERR_FILENO)) {}
  void operator()(uint64_t done, uint64_t total) {
    auto now = std::chrono::steady_clock::now();
    if (!started_) {  // the stream's first bytes, not the rendezvous and handshake before them
      started_ = true;
      t0_ = now;
      last_ = now;
    }
    double since = std::chrono::duration<double>(now - last_).count();
    if (done < total && since < (tty_ ? 0.2 : 5.0)) return;
    last_ = now;
    double s = std::chrono::duration<double>(now - t0_).count();
    double gbs = s > 0 ? done / s / 1e9 : 0;
    double eta = gbs > 0 ? (total - done) / 1e9 / gbs : 0;
    MemorySnapshot m = ReadMemory();
    std::fprintf(stderr, "%sload: %s / %s (%3.0f%%) %.2f GB/s ETA %.1f s, reader RSS anon %s file %s%s",
                 tty_ ? "\r" : "", HumanBytes(done).c_str(), HumanBytes(total).c_str(),
                 total ? 100.0 * done / total : 100.0, gbs, eta, HumanBytes(m.rss_anon).c_str(),
                 HumanBytes(m.rss_file).c_str(), tty_ ? (done >= total ? "\n" : "") : "\n");
    std::fflush(stderr);
  }

 private:
  bool tty_;
  bool started_ = false;
  std::chrono::steady_clock::time_point t0_, last_;
};

// --config as given (the user named it), else the checkpoint's own config.json, resolved beneath the
// checkpoint's root like its other files (a hub snapshot's is a symlink into blobs/; one out of the root
// is a CheckpointError). A config whose model_type has no builder (qwen2, gemma2, phi3, ...): the
// checkpoint's own tensors as stored (SpecFromCheckpoint), said once on rank 0.
ModelSpec SpecFor(const LoadArgs& a, int rank) {
  std::optional<std::string> json;
  std::string source;
  if (!a.config.empty()) {  // the file the user named, read as it is: any model_type, as the checkpoint's own
    json = ReadConfigFile(a.config);
    source = a.config;
  } else {
    json = ReadCheckpointConfig(a.checkpoint);
    source = a.checkpoint + "/config.json";
  }
  if (!json) throw Error(ErrorKind::kInvalidArgument, "--config", "not given, and " + a.checkpoint + "/config.json does not exist");
  if (HasBuilderFor(*json)) return BuildModelSpecFromJson(source, *json, SpecOptions{a.layers});
  const nlohmann::json j = nlohmann::json::parse(*json, nullptr, /*allow_exceptions=*/false);
  if (!j.is_object() || !j.contains("model_type") || !j["model_type"].is_string()) {
    return BuildModelSpecFromJson(source, *json, SpecOptions{a.layers});  // its error names the field
  }
  const std::string type = j["model_type"].get<std::string>();
  ModelSpec spec = SpecFromCheckpoint(*Checkpoint::Open(a.checkpoint), source, type, SpecOptions{a.layers});
  spec.config_json = *json;
  if (rank == 0 && !a.quiet) {
    std::fprintf(stderr,
                 "load: model_type \"%s\" has no shardcast builder: its %zu tensors as the checkpoint stores "
                 "them (no computed buffers; an fp8 checkpoint loads as stored)\n",
                 type.c_str(), spec.entries.size());
    if (a.layers >= 0 && spec.total_layers == 0) {
      std::fprintf(stderr, "load: --layers %d keeps every tensor: no key names a layer (layers.N., h.N., layer.N., "
                           "block.N., blocks.N.)\n", a.layers);
    }
    if (!a.dtype.empty()) std::fprintf(stderr, "load: --dtype %s changes nothing here: it dequantizes the fp8 "
                                                "weights a builder knows\n", a.dtype.c_str());
  }
  return spec;
}

void PrintReport(const LoadReport& r) {
  std::printf("load: %s -> %s over %s, %d rank(s), %llu entries, %s", r.source.c_str(), r.target.c_str(),
              r.backend.c_str(), r.world_size, static_cast<unsigned long long>(r.entries), HumanBytes(r.total_bytes).c_str());
  if (r.source_reason.rfind("auto", 0) == 0) std::printf(" (%s)", r.source_reason.c_str());
  if (r.dequantized) std::printf(", %llu dequantized from fp8", static_cast<unsigned long long>(r.dequantized));
  if (r.skipped_keys) {
    std::printf(", skipped %llu checkpoint key(s) the model does not own (e.g. %s)",
                static_cast<unsigned long long>(r.skipped_keys), r.skipped_examples.front().c_str());
  }
  double slowest = 0;
  uint64_t read = 0, sent = 0;
  for (const auto& rr : r.ranks) {
    slowest = std::max(slowest, rr.seconds);
    read += rr.bytes_read, sent += rr.bytes_sent;
  }
  // --setup-only moves no bytes: no rate (the planned bytes over the setup's seconds were reported as one)
  const double gbps = r.setup_only || slowest <= 0 ? 0.0 : r.total_bytes / slowest / 1e9;
  std::printf("\nload: %.3f s, %.2f GB/s%s; %s on %d node(s); storage reads %s = %.2fx the checkpoint, %s sent\n",
              slowest, gbps, r.setup_only ? " (setup only: no bytes moved)" : "", r.mesh.c_str(), r.nodes,
              HumanBytes(read).c_str(), r.checkpoint_bytes ? static_cast<double>(read) / r.checkpoint_bytes : 0.0,
              HumanBytes(sent).c_str());
  std::printf("%5s %12s %12s %12s %12s %9s %16s %16s %8s\n", "rank", "read", "received", "stored", "sent", "seconds",
              "peak RssAnon", "peak RssFile", "verify");
  for (const auto& rr : r.ranks) {
    std::printf("%5d %12s %12s %12s %12s %9.3f %16s %16s %8s\n", rr.rank, HumanBytes(rr.bytes_read).c_str(),
                HumanBytes(rr.bytes_received).c_str(), HumanBytes(rr.bytes_stored).c_str(),
                HumanBytes(rr.bytes_sent).c_str(), rr.seconds,
                HumanBytes(rr.peak_rss_anon).c_str(), HumanBytes(rr.peak_rss_file).c_str(),
                rr.verified == 1 ? "ok" : "off");
  }
  std::printf("(peak RSS above each rank's baseline at the start of the load)\n");
  std::printf("%5s %11s %11s %11s %11s %10s\n", "rank", "handshake", "allocate", r.setup_only ? "schedule" : "stream",
              "verify", "messages");
  for (const auto& rr : r.ranks) {
    std::printf("%5d %10.3fs %10.3fs %10.3fs %10.3fs %10llu\n", rr.rank, rr.handshake_seconds, rr.allocate_seconds,
                rr.stream_seconds, rr.verify_seconds, static_cast<unsigned long long>(rr.messages));
  }
  for (const auto& note : r.adopted) std::printf("rank 0 options adopted: %s\n", note.c_str());
}

// An algorithm named by --source (shardcast-bench's baseline), or none: shardcast's own Load.
const LoadAlgorithm* AlgorithmOf(const LoadArgs& a) {
  auto given_source = a.given.find(Option::kSource);
  auto it = a.algorithms.find(given_source == a.given.end() ? "" : given_source->second);
  return it == a.algorithms.end() ? nullptr : &it->second;
}

int RunRank(const LoadArgs& a) {
  Rendezvous rv = RendezvousFromEnvironment();
  const LoadAlgorithm* algorithm = AlgorithmOf(a);
  LoadArgs parsed = a;
  if (algorithm != nullptr) parsed.given.erase(Option::kSource);
  LoadRequest rq;
  rq.checkpoint = a.checkpoint;
  // A rank whose options are bad still joins the handshake with that problem, so no rank waits for it.
  std::optional<Error> bad_options;
  try {
    rq.options = BuildOptions(parsed);
  } catch (const Error& e) {
    bad_options = e;
  }
  rq.checksum_only = a.checksum_only;
  rq.setup_only = a.setup_only;
  const Target target = rq.options.target;
  ProgressPrinter printer;
  if (rv.rank == 0 && !a.quiet) rq.progress = [&printer](uint64_t d, uint64_t t) { printer(d, t); };

  if (a.backend != "gloo" && a.backend != "nccl") {
    throw Error(ErrorKind::kInvalidArgument, "--backend", "\"" + a.backend + "\" is not gloo or nccl");
  }
  if (a.backend == "nccl" && target != Target::kCuda) {
    throw Error(ErrorKind::kInvalidArgument, "--backend nccl", "needs --target cuda (NCCL moves device memory)");
  }
  // --backend nccl is NCCL at every world size: one GPU checks the NCCL path with a one-rank communicator.
  std::unique_ptr<Communicator> comm =
      a.backend == "nccl"      ? CreateNcclCommunicator(rv, rq.options.timeout, rv.local_rank)
      : rv.world_size == 1     ? CreateLocalCommunicator()
                               : CreateGlooCommunicator(rv, rq.options.timeout);
  std::unique_ptr<Plan> plan;
  std::unique_ptr<RankState> state;
  try {
    if (bad_options) throw *bad_options;
    ModelSpec spec = SpecFor(a, rv.rank);
    if (!a.dtype.empty()) spec = DequantizedSpec(spec, ParseFloatDType(a.dtype, "--dtype"));
    // FSDP2's Shard(0), HSDP's (Replicate(), Shard(0)) on (R, W / R), and with --tp the TP x FSDP layouts.
    const PlanOptions plan_options = ParallelPlan(spec, rv.world_size, ParallelSizes{a.replicas, a.tp});
    plan = std::make_unique<Plan>(Plan::Build(std::move(spec), rv.world_size, plan_options));
    PrepareOptions po;
    po.target = target;
    po.device_index = rv.local_rank;
    state = std::make_unique<RankState>(RankState::Prepare(*plan, rv.rank, po));
  } catch (const Error& e) {
    FailLoad(*comm, e.kind(), e.what());
  }
  LoadReport report = algorithm != nullptr ? (*algorithm)(*comm, state.get(), rq) : Load(*comm, state.get(), rq);
  if (rv.rank == 0) {
    PrintReport(report);
    if (!a.json.empty()) WriteTextFile(a.json, report.ToJson() + "\n");
  }
  return 0;
}

int RunLoad(const LoadArgs& a) {
  if (a.nproc > 0) {
    // Re-run ourselves as each rank: the same arguments without --nproc.
    std::vector<std::string> argv = {SelfExe()};
    for (size_t i = 1; i < a.argv.size(); ++i) {
      if (a.argv[i] == "--nproc" || a.argv[i] == "--nodes") {
        ++i;
        continue;
      }
      if (a.argv[i].rfind("--nproc=", 0) == 0 || a.argv[i].rfind("--nodes=", 0) == 0) continue;
      argv.push_back(a.argv[i]);
    }
    LoadArgs parsed = a;
    if (AlgorithmOf(a) != nullptr) parsed.given.erase(Option::kSource);
    const LoadOptions o = BuildOptions(parsed);  // a bad option fails here once, not in every rank
    return LaunchLocalRanks(a.nproc, argv, o.timeout + std::chrono::seconds(10), a.nodes);
  }
  return RunRank(a);
}

}  // namespace

void AddLoad(CLI::App& app, Runner* run, const std::vector<std::string>& argv,
             std::map<std::string, LoadAlgorithm> algorithms) {
  auto args = std::make_shared<LoadArgs>();
  args->argv = argv;
  std::string extra;
  for (const auto& [name, algorithm] : algorithms) extra += (extra.empty() ? "; " : ", ") + name;
  args->algorithms = std::move(algorithms);
  auto* cmd = app.add_subcommand("load", "Load a checkpoint into this rank's shard (every rank receives only its rows)");
  cmd->add_option("--checkpoint", args->checkpoint, "checkpoint directory or .safetensors file")->required();
  cmd->add_option("--config", args->config, "HF config.json (default: DIR/config.json)");
  cmd->add_option("--nproc", args->nproc, "launch N local ranks (like torchrun --standalone), 1-1024")
      ->check(CLI::Range(1, 1024));
  cmd->add_option("--dtype", args->dtype,
                  "bf16, f16 or f32: load block-quantized fp8 weights in this dtype, dequantized in the stream "
                  "(default: as the config declares them)");
  cmd->add_option("--replicas", args->replicas, "HSDP: R replicas x (world / R) shards (default 1: FSDP)");
  cmd->add_option("--tp", args->tp,
                  "tensor parallel: T ranks (column/row-parallel linears, experts over them), FSDP over the "
                  "rest (default 1)");
  cmd->add_option("--nodes", args->nodes, "with --nproc: split the ranks into N nodes (LOCAL_RANK, GROUP_RANK)");
  cmd->add_option("--backend", args->backend, "gloo (default) or nccl (with --target cuda; CUDA builds)");
  cmd->add_option("--layers", args->layers, "keep only the first N decoder layers of the config")->check(CLI::Range(0, 1 << 30));
  cmd->add_flag("--checksum-only", args->checksum_only,
                "receive and hash only, keep nothing (benchmarks); the report has each rank's digest of it");
  cmd->add_flag("--quiet", args->quiet, "no progress output");
  cmd->add_flag("--setup-only", args->setup_only,
                "handshake, allocation and schedule only; move no bytes (measures per-rank setup)");
  cmd->add_option("--json", args->json, "write the per-rank report as JSON (rank 0)");
  for (const OptionInfo& info : OptionTable()) {  // the load options, by the one table
    if (*info.flag == '\0') continue;
    const std::string help = std::string(info.help) + " (default " + info.default_text + "; " + info.environment + ")" +
                             (info.option == Option::kSource ? extra : "");
    if (info.is_switch) {
      cmd->add_flag(info.flag, args->switches[info.option], help);
    } else {
      cmd->add_option(info.flag, args->given[info.option], help);
    }
  }
  cmd->callback([args, run] { *run = [args] { return RunCommand("load", [&] { return RunLoad(*args); }); }; });
}

void AddOptions(CLI::App& app, Runner* run) {
  app.add_subcommand("options", "Print the load options (keyword, flag, variable, default) as a Markdown table")
      ->callback([run] {
        *run = [] {
          std::fputs(OptionTableMarkdown().c_str(), stdout);
          return 0;
        };
      });
}

}  // namespace shardcast::tools

