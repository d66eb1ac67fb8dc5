#include "runtime/load_options.h"

#include <algorithm>
#include <cstdlib>

#include "allocators/error.h"
#include "allocators/units.h"
#include "runtime/agree/fault.h"

namespace shardcast {
namespace {

[[noreturn]] void Bad(const std::string& origin, const std::string& text, const std::string& why) {
  throw Error(ErrorKind::kInvalidArgument, origin, "\"" + text + "\" " + why);
}

// The one parser of a timeout in ms, for Build and for Timeout (which needs it alone).
std::chrono::milliseconds ParseTimeout(const std::string& text, const std::string& origin) {
  const std::chrono::milliseconds timeout(ParseCount(text, origin, kMaxTimeoutMs));
  if (timeout.count() == 0) Bad(origin, text, "is not a timeout: it must be at least 1 ms");
  return timeout;
}

// "N" (N x N) or "RxC": fp8 scale blocks of R rows and C columns, each 1 to 2^20.
BlockSize ParseBlock(const std::string& text, const std::string& origin) {
  const size_t x = text.find_first_of("xX");
  const std::string rows = x == std::string::npos ? text : text.substr(0, x);
  const std::string cols = x == std::string::npos ? text : text.substr(x + 1);
  if (rows.empty() || cols.empty()) Bad(origin, text, "is not a block size: N or RxC, such as 128 or 128x128");
  const BlockSize b{ParseCount(rows, origin, 1u << 20), ParseCount(cols, origin, 1u << 20)};
  if (b.rows == 0 || b.cols == 0) Bad(origin, text, "is not a block size: each side must be at least 1");
  return b;
}

}  // namespace

const char* SourceName(Source source) {
  switch (source) {
    case Source::kAuto: return "auto";
    case Source::kRank0: return "rank0";
    case Source::kEachRank: return "each-rank";
    case Source::kNodeLeader: return "node-leader";
    case Source::kStriped: return "striped";
  }
  return "?";
}

const std::vector<OptionInfo>& OptionTable() {
  static const std::vector<OptionInfo> kTable = {
      {Option::kSource, "source", "--source", "SHARDCAST_SOURCE", false, "auto",
       "auto (rank 0 decides from who sees the files, the nodes and the layout), rank0, each-rank, node-leader or "
       "striped"},
      {Option::kTarget, "target", "--target", "SHARDCAST_TARGET", false, "cpu", "cpu, pinned or cuda"},
      {Option::kChunkBytes, "chunk_bytes", "--chunk-bytes", "SHARDCAST_CHUNK_BYTES", false, "64M (8M for target cuda)",
       "one staging slot, 4K-4G (e.g. 64M, 128MB)"},
      {Option::kStagingSlots, "staging_slots", "--staging-slots", "SHARDCAST_STAGING_SLOTS", false, "4 (8 for target cuda)",
       "slots in the staging ring, 2-64"},
      {Option::kReadaheadBytes, "readahead_bytes", "--readahead-bytes", "SHARDCAST_READAHEAD_BYTES", false,
       "256M a node, split over its reading ranks", "read ahead of the stream, per reading rank; 0 off"},
      {Option::kReadThreads, "read_threads", "--read-threads", "SHARDCAST_READ_THREADS", false,
       "the rank's share of the CPUs, 1-4 (1-8 for target cuda)", "threads that fill and read each rank's shards in a load, 1-64 (each "
       "reads a whole chunk at a time; at most staging_slots)"},
      {Option::kTimeoutMs, "timeout_ms", "--timeout-ms", "SHARDCAST_TIMEOUT_MS", false, "600000",
       "per-collective and store timeout in ms (Python: timeout= in seconds)"},
      {Option::kVerify, "verify", "--verify", "SHARDCAST_VERIFY", true, "0",
       "xxHash every entry on every rank and compare with the sender"},
      {Option::kStrictKeys, "strict_keys", "--strict-keys", "SHARDCAST_STRICT_KEYS", true, "0",
       "fail on checkpoint keys the model does not own"},
      {Option::kWeightBlockSize, "weight_block_size", "--weight-block-size", "SHARDCAST_WEIGHT_BLOCK_SIZE", false,
       "the config's, else 128", "fp8 scale blocks, N or RxC, for a checkpoint whose config.json names none"},
      {Option::kPread, "", "", "SHARDCAST_PREAD", false, "1",
       "pread each piece into its shard; 0: read through an mmap of each file"},
  };
  return kTable;
}

const OptionInfo& InfoOf(Option option) {
  for (const OptionInfo& info : OptionTable()) {
    if (info.option == option) return info;
  }
  throw Error(ErrorKind::kInternal, "load options", "an option missing from OptionTable()");
}

std::string OptionTableMarkdown() {
  std::string out = "| keyword | flag | variable | default | what |\n| --- | --- | --- | --- | --- |\n";
  for (const OptionInfo& i : OptionTable()) {
    auto code = [](const char* name) { return *name ? "`" + std::string(name) + "`" : std::string(); };
    out += "| " + code(i.keyword) + " | " + code(i.flag) + " | " + code(i.environment) + " | " + i.default_text +
           " | " + i.help + " |\n";
  }
  return out;
}

LoadOptionsBuilder& LoadOptionsBuilder::FromEnvironment() {
  for (const OptionInfo& info : OptionTable()) {
    const char* v = std::getenv(info.environment);
    if (v == nullptr || *v == '\0') continue;
    auto it = values_.find(info.option);
    if (it != values_.end() && it->second.explicit_) continue;
    values_[info.option] = Value{v, info.environment, false};
  }
  return *this;
}

LoadOptionsBuilder& LoadOptionsBuilder::Set(Option option, std::string value, std::string origin) {
  values_[option] = Value{std::move(value), std::move(origin), true};
  return *this;
}

LoadOptions LoadOptionsBuilder::Build() const {
  CheckFaultEnvironment();  // a malformed SHARDCAST_FAULT in a test is a bad option like any other
  LoadOptions o;
  for (const auto& [option, v] : values_) {
    const std::string& t = v.text;
    switch (option) {
      case Option::kSource:
        if (t == "auto") o.source = Source::kAuto;
        else if (t == "rank0") o.source = Source::kRank0;
        else if (t == "each-rank") o.source = Source::kEachRank;
        else if (t == "node-leader") o.source = Source::kNodeLeader;
        else if (t == "striped") o.source = Source::kStriped;
        else Bad(v.origin, t, "is not a source (auto, rank0, each-rank, node-leader or striped)");
        break;
      case Option::kTarget: {
        auto target = ParseTarget(t);
        if (!target) Bad(v.origin, t, "is not a target (cpu, pinned or cuda)");
        o.target = *target;
        break;
      }
      case Option::kChunkBytes:
        o.chunk_bytes = ParseBytes(t, v.origin, kMaxChunkBytes);
        if (o.chunk_bytes < kMinChunkBytes) Bad(v.origin, t, "is below the minimum chunk of 4096 bytes");
        break;
      case Option::kStagingSlots:
        o.staging_slots = static_cast<int>(ParseCount(t, v.origin, kMaxStagingSlots));
        if (o.staging_slots < kMinStagingSlots) Bad(v.origin, t, "is below 2 staging slots (reading overlaps sending)");
        break;
      case Option::kReadaheadBytes: o.readahead_bytes = ParseBytes(t, v.origin, kMaxReadaheadBytes); break;
      case Option::kReadThreads:
        o.read_threads = static_cast<int>(ParseCount(t, v.origin, kMaxReadThreads));
        if (*o.read_threads < 1) Bad(v.origin, t, "is not a thread count: it must be at least 1");
        break;
      case Option::kTimeoutMs: o.timeout = ParseTimeout(t, v.origin); break;
      case Option::kVerify: o.verify = ParseFlag(t, v.origin); break;
      case Option::kStrictKeys: o.strict_keys = ParseFlag(t, v.origin); break;
      case Option::kWeightBlockSize: o.weight_block = ParseBlock(t, v.origin); break;
      case Option::kPread: o.pread = ParseFlag(t, v.origin); break;
    }
  }
  // A CUDA target's pair where neither was given: one given keeps the other's CPU default, a combination
  // whose page-locked bytes (chunk x slots) the caller chose by giving it.
  if (o.target == Target::kCuda && values_.count(Option::kChunkBytes) == 0 && values_.count(Option::kStagingSlots) == 0) {
    o.chunk_bytes = kCudaChunkBytes;
    o.staging_slots = kCudaStagingSlots;
  }
  return o;
}

std::chrono::milliseconds LoadOptionsBuilder::Timeout() const noexcept {
  try {
    auto it = values_.find(Option::kTimeoutMs);
    return it == values_.end() ? LoadOptions{}.timeout : ParseTimeout(it->second.text, it->second.origin);
  } catch (...) {  // a timeout that does not parse: the default
    return LoadOptions{}.timeout;
  }
}

uint64_t ReadaheadFor(const LoadOptions& options, int readers_on_node) {
  if (options.readahead_bytes) return *options.readahead_bytes;
  return readers_on_node > 0 ? kNodeReadaheadBytes / static_cast<uint64_t>(readers_on_node) : 0;
}

int ReadThreadsFor(const LoadOptions& options, int readers_on_node, int cores) {
  const int slots = std::max(1, options.staging_slots);
  if (options.read_threads) return std::min(*options.read_threads, slots);
  const int share = readers_on_node > 0 ? cores / readers_on_node : 1;
  const int most = options.target == Target::kCuda ? kCudaMaxReadThreads : kDefaultMaxReadThreads;
  return std::clamp(share, 1, std::min(most, slots));
}

LoadOptions LoadOptionsFromEnvironment() { return LoadOptionsBuilder().FromEnvironment().Build(); }

}  // namespace shardcast
