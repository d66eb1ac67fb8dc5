// shardcast inspect PATH [--json]: validate a file or checkpoint directory and list its tensors, each
// with the quantized format it belongs to (loaders/quantization.h: fp8, mxfp4, nvfp4 and their scales).
#include <CLI/CLI.hpp>
#include <cstdio>
#include <iostream>
#include <nlohmann/json.hpp>

#include "loaders/checkpoint.h"
#include "loaders/quantization.h"
#include "tools/cli_util.h"
#include "tools/commands.h"

namespace shardcast::tools {
namespace {

struct InspectArgs {
  std::string path;
  bool json = false;
};

std::string BaseName(const std::string& p) {
  auto s = p.rfind('/');
  return s == std::string::npos ? p : p.substr(s + 1);
}

// JSON output is ASCII: every non-ASCII character as \uXXXX, and bytes that are not UTF-8 (a path
// may hold any) as U+FFFD, where nlohmann's default would throw type_error.316. Control characters
// are \u escapes either way, so nothing in it can drive a terminal.
std::string JsonText(const nlohmann::ordered_json& j) {
  return j.dump(2, ' ', /*ensure_ascii=*/true, nlohmann::json::error_handler_t::replace);
}

int Inspect(const InspectArgs& a) {
  // Headers only, read with pread: a map of every file would need address space for the whole checkpoint
  // (refused under ulimit -v at 8B-scale files, where load, which preads, went through).
  OpenOptions headers_only;
  headers_only.mode = ReadMode::kPread;
  auto ckpt = Checkpoint::Open(a.path, headers_only);
  const std::vector<std::string> keys = ckpt->keys();  // sorted; a copy, made once
  uint64_t total = 0;
  if (a.json) {
    nlohmann::ordered_json out;
    out["path"] = a.path;
    out["files"] = nlohmann::json::array();
    for (size_t i = 0; i < ckpt->num_files(); ++i) out["files"].push_back(ckpt->file(i).path());
    auto& tensors = out["tensors"] = nlohmann::json::array();
    for (const auto& key : keys) {
      const auto& e = ckpt->Get(key);
      const TensorQuant q = QuantOf(*ckpt, key);
      tensors.push_back({{"key", key}, {"dtype", std::string(DTypeName(e.info->dtype))}, {"shape", e.info->shape},
                         {"bytes", e.info->nbytes()}, {"file", BaseName(e.file->path())},
                         {"quant", std::string(QuantRoleName(q.role))}, {"quant_partner", q.partner}});
      total += e.info->nbytes();
    }
    out["total_tensors"] = keys.size();
    out["total_bytes"] = total;
    std::cout << JsonText(out) << "\n";
    return 0;
  }
  // Keys and file names come from the checkpoint: escaped, so none can drive the terminal.
  size_t key_w = 3;
  for (const auto& key : keys) key_w = std::max(key_w, EscapeForTerminal(key).size());
  key_w = std::min<size_t>(key_w, 72);
  std::printf("%-*s  %-8s  %-22s  %14s  %-12s  %s\n", static_cast<int>(key_w), "key", "dtype", "shape", "bytes",
              "quant", "file");
  for (const auto& key : keys) {
    const auto& e = ckpt->Get(key);
    const std::string quant(QuantRoleName(QuantOf(*ckpt, key).role));
    std::printf("%-*s  %-8s  %-22s  %14llu  %-12s  %s\n", static_cast<int>(key_w), EscapeForTerminal(key).c_str(),
                std::string(DTypeName(e.info->dtype)).c_str(), ShapeText(e.info->shape).c_str(),
                static_cast<unsigned long long>(e.info->nbytes()), quant.empty() ? "-" : quant.c_str(),
                EscapeForTerminal(BaseName(e.file->path())).c_str());
    total += e.info->nbytes();
  }
  std::printf("\n%zu tensors, %llu bytes (%s) in %zu file(s)\n", keys.size(),
              static_cast<unsigned long long>(total), HumanBytes(total).c_str(), ckpt->num_files());
  return 0;
}

}  // namespace

void AddInspect(CLI::App& app, Runner* run) {
  auto args = std::make_shared<InspectArgs>();
  auto* cmd = app.add_subcommand("inspect", "Validate a safetensors file or checkpoint directory and list its tensors");
  cmd->add_option("path", args->path, "a .safetensors file, or a directory with model.safetensors[.index.json]")
      ->required();
  cmd->add_flag("--json", args->json, "print JSON instead of a table");
  cmd->callback([args, run] { *run = [args] { return RunCommand("inspect", [&] { return Inspect(*args); }); }; });
}

}  // namespace shardcast::tools
