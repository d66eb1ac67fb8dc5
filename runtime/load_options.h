// runtime/load_options: how a load runs, and the one place options are built.
//
// LoadOptions is a plain struct; every field has a documented default. LoadOptionsBuilder is the only
// way the CLI and the Python binding make one: it reads SHARDCAST_* variables, takes explicit values
// (flags, keywords) that beat them, parses every value with the one parser (allocators/units.h),
// checks bounds, and names the value's origin in every error:
//
//   LoadOptionsBuilder b;                       // defaults
//   b.FromEnvironment();                        // SHARDCAST_CHUNK_BYTES=64MiB ... (parsed in Build)
//   b.Set(Option::kChunkBytes, "128M", "--chunk-bytes");   // explicit: wins over the variable
//   LoadOptions o = b.Build();                  // kInvalidArgument: '--chunk-bytes: "1e30" is not a size'
//
// A bad environment value that an explicit value overrides is never parsed, so a flag can always
// repair a bad variable. Which options shape the stream and how ranks agree on them: see manifest.h
// (StreamParams): the reader's values win; verify and strict_keys must match on every rank.
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "loaders/quant/block_size.h"
#include "runtime/layout/target.h"

namespace shardcast {

enum class Source : uint8_t {
  kAuto,        // rank 0 decides from who sees the files, the nodes and the layouts (ChooseSource)
  kRank0,       // rank 0 reads and sends each rank only its rows (scatter); storage on rank 0 only
  kEachRank,    // every rank reads its own rows; storage every rank sees; no data communication
  kNodeLeader,  // the first rank of each node reads its node's rows and sends them within the node
  kStriped,     // each shard's rows are read by one of its holders, which sends the other replicas theirs
};
inline constexpr int kNumSources = 5;
const char* SourceName(Source source);

struct LoadOptions {
  Source source = Source::kAuto;                      // default kAuto                  (SHARDCAST_SOURCE)
  Target target = Target::kCpu;                       // default kCpu                   (SHARDCAST_TARGET)
  // One staging slot (SHARDCAST_CHUNK_BYTES) and the slots in the ring (SHARDCAST_STAGING_SLOTS). Defaults
  // 64 MiB x 4; for a CUDA target 8 MiB x 8 (kCudaChunkBytes), applied by Build where neither was given
  // (where one was, the other keeps its CPU default).
  uint64_t chunk_bytes = 64ull << 20;
  int staging_slots = 4;
  // Read-ahead of the stream's reader (SHARDCAST_READAHEAD_BYTES; 0 off). Unset: ReadaheadFor's default.
  std::optional<uint64_t> readahead_bytes;
  // Threads reading this rank's checkpoint bytes (SHARDCAST_READ_THREADS). Unset: ReadThreadsFor's default.
  std::optional<int> read_threads;
  std::chrono::milliseconds timeout{10 * 60 * 1000};  // default 10 min per collective     (SHARDCAST_TIMEOUT_MS)
  bool verify = false;                                // default false: xxHash every entry (SHARDCAST_VERIFY)
  bool strict_keys = false;                           // default false: skip extra keys    (SHARDCAST_STRICT_KEYS)
  bool pread = true;                                  // default true: pread; false: mmap   (SHARDCAST_PREAD)
  bool release_pages = true;                          // default true: give consumed file pages back
  // The fp8 scale blocks the caller says the checkpoint was quantized in (SHARDCAST_WEIGHT_BLOCK_SIZE: "128"
  // or "128x64", rows x cols). Unset: the checkpoint's config.json decides, else 128 x 128. Where the config
  // names another block, the load fails (WeightBlock in runtime/handshake.cc).
  std::optional<BlockSize> weight_block;

  uint64_t staging_bytes() const { return chunk_bytes * static_cast<uint64_t>(staging_slots); }
};

// The read-ahead of one reader: the option where it was given; else a node-wide 256 MiB shared by the
// node's `readers_on_node` reading ranks (rank0 and node-leader: one reader, 256 MiB; each-rank with 4
// ranks on the node: 64 MiB each). Measured at W=4 on the 2 vCPU VM (bench/RESULTS.md): rank0 cold at
// 6.38 GB 7.3-7.9 s with 256 MiB against 8.0-8.4 s without; each-rank cold at 6.38 GB 5.3-6.3 s with
// 256 MiB *each* against 4.3-4.8 s without (four readers 1 GiB ahead of themselves contend); each-rank
// at 1.91 GB (dcp.load, medians of 3): cold 1.56-1.59 s with 64 MiB each (16-128 MiB alike) against
// 1.67 s without, warm 0.73 s against 0.69 s. Real loads of 229B-671B checkpoints are cold.
inline constexpr uint64_t kNodeReadaheadBytes = 256ull << 20;
uint64_t ReadaheadFor(const LoadOptions& options, int readers_on_node);

// The reader threads of one reading rank: the option where it was given; else `cores` shared by the node's
// `readers_on_node` reading ranks (load.cc passes a bound rank's own CPUs with 1), 1 to
// kDefaultMaxReadThreads (kCudaMaxReadThreads for a CUDA target), and never more than the staging slots
// (each thread reads a whole chunk into a slot of its own). One thread `pread`s at about 5 GB/s from the
// page cache on the GPU hosts measured (bench/RESULTS.md), below a host-to-device copy; on a node whose
// ranks already fill its cores, one thread each.
inline constexpr int kDefaultMaxReadThreads = 4;
int ReadThreadsFor(const LoadOptions& options, int readers_on_node, int cores);

// A CUDA target's defaults: more, smaller page-locked slots and more readers. Each slot goes to the GPU once
// it is read, so small slots overlap reading with copying finely, and 64 MiB are page-locked per load
// instead of 256. Measured on an H100 host (one rank, 16 cores, `dcp.load` of a 1.91 GB Llama, warm, medians
// of 3, these values set by SHARDCAST_* variables; bench/RESULTS.md): 8 MiB x 8 with 8 readers 0.110 s
// against 16 MiB x 4 with 4 readers 0.170 s and torch's reader 0.363 s in the same call; in an earlier call
// on the same machine, 64 MiB x 4 with 4 readers 0.187 s, 16 MiB x 4 0.165 s, 32 MiB x 8 with 8 readers
// 0.190 s. Not yet measured with more than one rank per host.
inline constexpr uint64_t kCudaChunkBytes = 8ull << 20;
inline constexpr int kCudaStagingSlots = 8;
inline constexpr int kCudaMaxReadThreads = 8;

// Bounds every builder enforces (and names in its errors).
inline constexpr uint64_t kMinChunkBytes = 4096;
inline constexpr uint64_t kMaxChunkBytes = 4ull << 30;
inline constexpr int kMinStagingSlots = 2;
inline constexpr int kMaxStagingSlots = 64;
inline constexpr int kMaxReadThreads = 64;
inline constexpr uint64_t kMaxReadaheadBytes = 64ull << 30;
inline constexpr int64_t kMaxTimeoutMs = 7ll * 24 * 3600 * 1000;

enum class Option {
  kSource, kTarget, kChunkBytes, kStagingSlots, kReadaheadBytes, kReadThreads, kTimeoutMs, kVerify, kStrictKeys,
  kWeightBlockSize, kPread,
};

// The one table of load options: every name an option goes by, its default and what it does. The builder
// reads the environment through it, `shardcast load` makes its flags from it, the Python binding its
// keywords, and `shardcast options` prints it as the README's table (a test keeps the two equal).
struct OptionInfo {
  Option option;
  const char* keyword;      // the binding's name (Python's load(...) keyword; timeout= in seconds there);
                            // "" where Python has none (the variable alone)
  const char* flag;         // `shardcast load`'s flag; "" where it has none
  const char* environment;  // the SHARDCAST_* variable
  bool is_switch;           // a flag that takes no value (--verify); its variable is 0/1, true/false
  const char* default_text;
  const char* help;
};
const std::vector<OptionInfo>& OptionTable();
const OptionInfo& InfoOf(Option option);
// The table as Markdown: | keyword | flag | variable | default | what |.
std::string OptionTableMarkdown();

class LoadOptionsBuilder {
 public:
  // Records every SHARDCAST_* variable that is set (see LoadOptions); parsing waits for Build.
  LoadOptionsBuilder& FromEnvironment();
  // An explicit value; `origin` names it in errors ("--chunk-bytes", "chunk_bytes="). Beats the
  // environment whatever the call order.
  LoadOptionsBuilder& Set(Option option, std::string value, std::string origin);
  // Throws kInvalidArgument naming the origin, the value and the bound.
  LoadOptions Build() const;
  // The timeout alone, for a rank whose other options fail to build (a bad SHARDCAST_TARGET): it still
  // waits for the others as long as they wait for it. The given or SHARDCAST_TIMEOUT_MS value where it
  // parses, else the default. Never throws.
  std::chrono::milliseconds Timeout() const noexcept;

 private:
  struct Value {
    std::string text, origin;
    bool explicit_ = false;
  };
  std::map<Option, Value> values_;
};

// The environment and nothing else (tools that take no load flags, e.g. plan's forecast).
LoadOptions LoadOptionsFromEnvironment();

}  // namespace shardcast
