// shardcast convert SRC DST --dtype bf16|f16|f32 [--nproc N] [--max-shard-size SIZE] [--overwrite]
// An fp8 checkpoint as a bf16 (f16, f32) one, with bounded memory (loaders/convert.h). The output
// appears at DST only once complete: it is written into DST.tmp-<id>, then renamed. With --nproc N,
// N local processes each write their share of the output files.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <vector>

#include "allocators/error.h"
#include "allocators/memory_probe.h"
#include "allocators/units.h"
#include "loaders/checkpoint.h"
#include "loaders/convert.h"
#include "loaders/model_spec.h"
#include "runtime/engine/file_sink.h"
#include "tools/cli_util.h"
#include "tools/commands.h"
#include "tools/launcher.h"
#include "tools/subprocess.h"

namespace shardcast::tools {
namespace {

namespace fs = std::filesystem;

struct ConvertArgs {
  std::string src, dst, dtype = "bf16", max_shard = "5GB", worker_dir;
  int nproc = 0;
  bool overwrite = false;
};

uint64_t Above(uint64_t v, uint64_t base) { return v > base ? v - base : 0; }

ConvertOptions Options(const ConvertArgs& a, const std::string& config) {
  ConvertOptions o;
  o.target = ParseFloatDType(a.dtype, "--dtype");
  o.max_shard_bytes = ParseBytes(a.max_shard, "--max-shard-size");
  o.block = ConfigWeightBlockSize(a.src + "/config.json", config).value_or(BlockSize{});
  return o;
}

// One process's share: output files f with f % world == rank.
int WriteShare(const ConvertArgs& a, int rank, int world) {
  const auto t0 = std::chrono::steady_clock::now();
  const MemorySnapshot base = ReadMemory();
  PeakSampler sampler;
  const std::string config = ReadCheckpointConfig(a.src).value_or("{}");
  auto in = Checkpoint::Open(a.src);
  const ConvertOptions o = Options(a, config);
  const ConvertPlan plan = PlanConvert(*in, o);
  int files = 0;
  for (size_t f = static_cast<size_t>(rank); f < plan.files.size(); f += static_cast<size_t>(world)) {
    WriteConvertedFile(*in, plan, f, a.worker_dir, o);
    ++files;
  }
  const MemoryPeaks peaks = sampler.Stop();
  std::printf("{\"rank\": %d, \"files\": %d, \"seconds\": %.3f, \"peak_rss_anon\": %llu, \"peak_rss_file\": %llu}\n",
              rank, files, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(),
              static_cast<unsigned long long>(Above(peaks.rss_anon, base.rss_anon)),
              static_cast<unsigned long long>(Above(peaks.rss_file, base.rss_file)));
  return 0;
}

// Copies the regular file `in` (its size from fstat) to a new file `path`, in 1 MiB pieces.
void CopyOpenFile(const OpenNode& in, const std::string& src_path, const std::string& path) {
  UniqueFd out(::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644));
  if (out.get() < 0) throw Error(ErrorKind::kIo, path, "cannot create: " + ErrnoText(errno));
  std::vector<char> buf(1 << 20);
  for (uint64_t done = 0, size = static_cast<uint64_t>(in.st.st_size); done < size;) {
    const ssize_t got = ::pread(in.fd.get(), buf.data(), std::min<uint64_t>(buf.size(), size - done), static_cast<off_t>(done));
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0) throw Error(ErrorKind::kIo, src_path, "read: " + (got < 0 ? ErrnoText(errno) : "file shrank"));
    for (ssize_t put = 0; put < got;) {
      const ssize_t n = ::write(out.get(), buf.data() + put, static_cast<size_t>(got - put));
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) throw Error(ErrorKind::kIo, path, "write: " + ErrnoText(errno));
      put += n;
    }
    done += static_cast<uint64_t>(got);
  }
  if (::fsync(out.get()) != 0) throw Error(ErrorKind::kIo, path, "fsync: " + ErrnoText(errno));
}

// The files beside the weights that a converted checkpoint keeps (tokenizer, generation config, code).
// Each name resolves beneath the checkpoint's root, as the weights do: a symlink out of it is an error.
void CopySideFiles(const std::string& src, const std::string& dst) {
  if (!fs::is_directory(src)) return;
  for (const auto& e : fs::directory_iterator(src)) {
    const std::string name = e.path().filename();
    if (name == "config.json" || name == kIndexFileName) continue;
    if (name.size() > 12 && name.compare(name.size() - 12, 12, ".safetensors") == 0) continue;
    std::optional<OpenNode> in = OpenCheckpointName(src, name);
    if (!in || !S_ISREG(in->st.st_mode) || in->st.st_size > (1ll << 30)) continue;
    CopyOpenFile(*in, e.path().string(), dst + "/" + name);
  }
}

int RunConvert(const ConvertArgs& a) {
  if (!a.worker_dir.empty()) {  // a process of --nproc: RANK and WORLD_SIZE from the launcher
    const char* rank = std::getenv("RANK");
    const char* world = std::getenv("WORLD_SIZE");
    return WriteShare(a, rank ? std::atoi(rank) : 0, world ? std::max(1, std::atoi(world)) : 1);
  }
  const auto t0 = std::chrono::steady_clock::now();
  std::error_code ec;
  if (fs::exists(a.dst, ec) && fs::exists(a.src, ec)) {
    // DST is SRC, or a folder holding it: --overwrite would replace the input with the output
    const fs::path dst_real = fs::canonical(a.dst, ec);
    for (fs::path p = fs::canonical(a.src, ec); !ec && !p.empty(); p = p.parent_path()) {
      if (p == dst_real) {
        throw Error(ErrorKind::kInvalidArgument, a.dst,
                    (p == fs::canonical(a.src, ec) ? std::string("is SRC itself") : "holds SRC") +
                        ": convert writes a new checkpoint beside its input (--overwrite would replace the input "
                        "with it); give another directory");
      }
      if (p == p.parent_path()) break;
    }
  }
  if (fs::exists(a.dst, ec) && !a.overwrite) {
    throw Error(ErrorKind::kInvalidArgument, a.dst, "exists; pass --overwrite to replace it");
  }
  fs::path dst = fs::absolute(a.dst).lexically_normal();
  if (!dst.has_filename()) dst = dst.parent_path();  // "out/": the directory out
  const fs::path parent = dst.parent_path();
  const std::string base = dst.filename();
  for (const std::string& left : output_dir::Leftovers((parent / base).string())) {
    if (!a.overwrite) {
      throw Error(ErrorKind::kInvalidArgument, left,
                  "is left over from an earlier convert or save that did not finish; remove it or pass --overwrite");
    }
    output_dir::RemoveTree(left);
  }
  const std::string config = ReadCheckpointConfig(a.src).value_or("{}");
  auto in = Checkpoint::Open(a.src);
  const ConvertOptions o = Options(a, config);
  const ConvertPlan plan = PlanConvert(*in, o);
  std::fprintf(stderr, "convert: %llu fp8 weights to %s, %llu tensors copied, %llu scales consumed; %s -> %s in %zu file(s)\n",
               static_cast<unsigned long long>(plan.dequantized), std::string(DTypeName(o.target)).c_str(),
               static_cast<unsigned long long>(plan.copied), static_cast<unsigned long long>(plan.dropped_scales),
               HumanBytes(plan.input_bytes).c_str(), HumanBytes(plan.output_bytes).c_str(), plan.files.size());
  const std::string tmp = (parent / (base + ".tmp-" + std::to_string(getpid()))).string();
  fs::create_directories(tmp);
  try {
    if (a.nproc > 1) {
      std::vector<std::string> argv = {SelfExe(), "convert", a.src, a.dst, "--dtype", a.dtype, "--max-shard-size",
                                       a.max_shard, "--worker-dir", tmp};
      const int rc = LaunchLocalRanks(a.nproc, argv, std::chrono::seconds(30));
      if (rc != 0) throw Error(ErrorKind::kIo, a.dst, "a convert process failed (exit " + std::to_string(rc) + ")");
    } else {
      const MemorySnapshot base = ReadMemory();
      PeakSampler sampler;
      for (size_t f = 0; f < plan.files.size(); ++f) WriteConvertedFile(*in, plan, f, tmp, o);
      const MemoryPeaks peaks = sampler.Stop();
      std::fprintf(stderr, "convert: peak RssAnon %s, RssFile %s above the process's baseline\n",
                   HumanBytes(Above(peaks.rss_anon, base.rss_anon)).c_str(),
                   HumanBytes(Above(peaks.rss_file, base.rss_file)).c_str());
    }
    // Every numbered file needs its index (one file of "model-00001-of-00001" too); model.safetensors none.
    if (plan.files.size() > 1 || plan.files.front().name != kSingleFileName) WriteCheckpointIndex(tmp, plan.files);
    WriteSmallFileAtomically(tmp + "/config.json", ConvertedConfig(config, o.target));
    CopySideFiles(a.src, tmp);
    output_dir::Commit(tmp, (parent / base).string());  // save's commit: atomic, the parent fsynced
  } catch (...) {
    fs::remove_all(tmp, ec);
    throw;
  }
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::printf("convert: %s written to %s in %.2f s (%.2f GB/s of output, %.2f GB/s of input)\n",
              HumanBytes(plan.output_bytes).c_str(), a.dst.c_str(), s, plan.output_bytes / s / 1e9,
              plan.input_bytes / s / 1e9);
  return 0;
}

}  // namespace

void AddConvert(CLI::App& app, Runner* run) {
  auto args = std::make_shared<ConvertArgs>();
  auto* cmd = app.add_subcommand("convert", "Rewrite an fp8, MXFP4 or NVFP4 checkpoint with its weights dequantized (bf16, f16, f32)");
  cmd->add_option("src", args->src, "input checkpoint directory")->required();
  cmd->add_option("dst", args->dst, "output directory (appears only when complete)")->required();
  cmd->add_option("--dtype", args->dtype, "bf16 (default), f16 or f32");
  cmd->add_option("--nproc", args->nproc, "N local processes, each writing its share of the files (1-1024)")
      ->check(CLI::Range(1, 1024));
  cmd->add_option("--max-shard-size", args->max_shard, "largest output file, e.g. 5GB (default)");
  cmd->add_flag("--overwrite", args->overwrite, "replace DST (and leftovers of an unfinished convert)");
  cmd->add_option("--worker-dir", args->worker_dir)->group("");  // internal: one process's share
  cmd->callback([args, run] { *run = [args] { return RunCommand("convert", [&] { return RunConvert(*args); }); }; });
}

}  // namespace shardcast::tools
