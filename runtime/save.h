// runtime/save: the call after training. Every rank of the communicator calls Save together; FSDP2's
// dim-0 shards go straight into a Hugging Face checkpoint (safetensors files + index), with no gather.
// A dim-0 shard is a contiguous byte range of its tensor in the file, so a rank's rows are written at
// their final offsets. It is the load's stream with the data flowing the other way:
//
//   1. layout (rank 0): output tensors assigned to files in model order by max_shard_bytes (as
//      transformers shards), headers, offsets and index -> a Manifest whose parts are the output
//      tensors at their file offsets; broadcast; every rank checks it; one verdict    "save layout"
//   2. create (rank 0): out_dir.tmp-<id>, every file at its final size with its header  "save create"
//      (each-rank: every rank opens every file and checks it sees rank 0's)              "save open"
//   3. stream: the Schedule of that manifest, read from each rank's shards (ShardSource), written at
//      the segments' file offsets (FileSink); route save-rank0 or save-each-rank
//   4. each rank fdatasyncs what it wrote                                                  "save write"
//   5. commit (rank 0): index, config.json, generation_config.json (and, keep_other_files, the other
//      files of an existing out_dir), then the directory renamed into place atomically (exchanged
//      with an existing out_dir under overwrite)                                          "save commit"
//   6. every rank's report, gathered to every rank
//
// A kill -9 of any rank at any moment leaves the previous out_dir intact, or no out_dir: never a
// partial one. Rank 0 removes its tmp directory on any failure it sees; one left by a rank 0 that
// died is named by the next save's error (or removed under overwrite).
//
// Failure: shardcast::Error, the same kind and message on every rank: kInvalidArgument (out_dir
// exists, a leftover tmp directory, ranks asking for different saves), kManifestMismatch (ranks'
// models differ), kIo (disk full: ENOSPC/EFBIG, naming file, byte range and rank), kComm/kCommTimeout
// (a rank died or stalled), kUnsupported.
#pragma once

#include <map>
#include <optional>
#include <string>
#include <vector>

#include "runtime/agree/communicator.h"
#include "runtime/load_options.h"
#include "runtime/materialize/materializer.h"
#include "runtime/stream/progress.h"

namespace shardcast {

struct SaveOutput {
  std::string key;              // the output file's key (e.g. transformers' per-expert name)
  std::vector<uint64_t> shape;  // its own shape
};

struct SaveRequest {
  std::string out_dir;
  // From LoadOptionsBuilder: source is the mode (kRank0: rank 0 writes every byte, for node-local
  // disks; kEachRank: every rank writes its own rows into files every rank sees), chunk_bytes,
  // staging_slots, readahead_bytes and timeout as for a load. verify and strict_keys do not apply.
  LoadOptions options;
  // model key -> the output tensors its elements become, concatenated in this order (a fused expert
  // [E, 2I, H] -> gate_0, up_0, gate_1, ...). Default (absent): one tensor, its own key and shape.
  std::map<std::string, std::vector<SaveOutput>> outputs;
  std::optional<DType> dtype;                // default none: each shard's dtype. Else F16/BF16/F32 entries
                                             // are written in this dtype (F16, BF16 or F32)
  uint64_t max_shard_bytes = 5000000000ull;  // default 5 GB (decimal, transformers' default)
  bool overwrite = false;                    // default false: an existing out_dir is an error
  std::string config_json;                   // default "": no config.json
  std::string generation_config_json;        // default "": no generation_config.json
  Progress progress;                         // default none
  // Default empty: output tensors go into files by max_shard_bytes, in model order. Else every output
  // tensor's file number, 1 to n (torch DCP's fqn_to_index_mapping; keys no entry writes are ignored):
  // the files are model-0000k-of-0000n.safetensors, n the largest number in the map, each holding the
  // tensors numbered k (a number no tensor has makes no file), and the index is written even for n = 1.
  // An output tensor without a number is kInvalidArgument. Rank 0's governs: its files are in the
  // agreed manifest.
  std::map<std::string, uint32_t> file_numbers;
  // Default false: one file by max_shard_bytes is model.safetensors, without an index (save_pretrained's
  // names). True: files are always model-0000k-of-0000n.safetensors with an index, also for n = 1 (torch
  // DCP's HF writer's names); implied by file_numbers.
  bool numbered_files = false;
  // Default false: an existing out_dir is replaced as a whole (under overwrite). True: what an existing
  // out_dir holds besides its *.safetensors files and model.safetensors.index.json, and that this save
  // does not write itself (a tokenizer, a README, folders), is carried into the new out_dir before the
  // one atomic swap, as hard links (copies where the filesystem has none).
  bool keep_other_files = false;
};

struct SaveRankReport {
  int rank = 0;
  uint64_t bytes_written = 0, bytes_sent = 0, bytes_received = 0, bytes_read = 0, files_written = 0;
  double seconds = 0, layout_seconds = 0, create_seconds = 0, stream_seconds = 0, sync_seconds = 0,
         commit_seconds = 0;
  uint64_t peak_rss_anon = 0, peak_rss_file = 0;  // above this rank's baseline at the start of Save
  uint64_t baseline_rss_anon = 0, baseline_rss_file = 0;
};

struct SaveReport {
  std::string out_dir, mode, backend;
  int world_size = 1;
  uint64_t entries = 0, tensors = 0, total_bytes = 0;  // total_bytes: data, as the index's total_size
  std::vector<std::string> files;                      // names, in out_dir
  uint64_t chunk_bytes = 0;
  int staging_slots = 0;
  double seconds = 0;                  // this rank's wall time
  std::vector<SaveRankReport> ranks;   // every rank's, gathered
  std::string ToJson() const;
};

// REQUIRES: state over this rank's local tensors for a plan of comm.world_size() ranks (checked).
SaveReport Save(Communicator& comm, RankState* state, const SaveRequest& request);

// For a rank that failed before it could call Save: enters the save's layout agreement with its
// problem (runtime/agree/agreement.h), so every rank raises the same error instead of waiting. Always throws.
[[noreturn]] void FailSave(Communicator& comm, ErrorKind kind, const std::string& problem);

}  // namespace shardcast
