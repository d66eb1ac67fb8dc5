// loaders/writer: streaming, atomic safetensors writers.
//
// The header is written first with every size known, padded with spaces so the data area starts
// 8-byte aligned; data follows in entry order. Nothing appears under a final name until Commit():
// each file is written to "<name>.tmp-<pid>", fsynced, then renamed, and the directory fsynced.
// Destroying a writer that was not committed removes its temp files.
//
// Thread safety: one writer is used by one thread at a time.
// Failure: throws shardcast::Error (kIo naming the file, kInvalidArgument for misuse).
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "loaders/dtype.h"

namespace shardcast {

struct WriteEntry {
  std::string key;
  DType dtype = DType::kF32;
  std::vector<uint64_t> shape;
  uint64_t nbytes() const;
};

using Metadata = std::vector<std::pair<std::string, std::string>>;

// The serialized header (length prefix included) for entries laid out in order.
std::string BuildHeader(const std::vector<WriteEntry>& entries, const Metadata& metadata);

class SafetensorsWriter {
 public:
  // Writes the header to a temp file beside `path`.
  SafetensorsWriter(std::string path, std::vector<WriteEntry> entries, const Metadata& metadata = {});
  ~SafetensorsWriter();
  SafetensorsWriter(const SafetensorsWriter&) = delete;
  SafetensorsWriter& operator=(const SafetensorsWriter&) = delete;

  // Appends the next n data bytes (entries' data back to back, in order).
  void Append(const void* data, size_t n);
  // Instead of Append: makes the whole data area a hole (reads as zeros, uses no disk).
  void AppendHole();
  uint64_t data_bytes() const { return data_bytes_; }
  uint64_t written() const { return written_; }
  // REQUIRES: every data byte appended. fsync, rename to the final name. Idempotent.
  void Commit();
  // Like Commit, but leaves the file under its temp name for a caller that renames a set at once.
  void Finish();
  void Publish();  // REQUIRES: Finish() called. The rename step.

 private:
  std::string path_, tmp_path_;
  int fd_ = -1;
  uint64_t header_bytes_ = 0, data_bytes_ = 0, written_ = 0;
  bool finished_ = false, published_ = false;
};

// Produces bytes [offset, offset + n) of an entry's data into out.
using DataSource = std::function<void(const WriteEntry& entry, uint64_t offset, unsigned char* out, size_t n)>;

struct CheckpointWriteOptions {
  uint64_t max_shard_bytes = 0;   // default 0: one file, model.safetensors. Else split by this size.
  bool sparse = false;            // default false. true: data areas are holes, source is never called
  size_t chunk_bytes = 8u << 20;  // default 8 MiB: the buffer DataSource fills at a time
  Metadata metadata = {{"format", "pt"}};  // default {"format": "pt"}, what transformers writes
};

struct WrittenCheckpoint {
  std::vector<std::string> files;  // final paths
  uint64_t total_bytes = 0;        // data bytes across files
};

// How entries are split into files: greedily in entry order, a tensor larger than the limit in a file
// of its own; names model-0000i-of-0000N.safetensors, or model.safetensors when max_shard_bytes is 0.
struct CheckpointFile {
  std::string name;
  std::vector<WriteEntry> entries;
  uint64_t data_bytes = 0;
};
std::vector<CheckpointFile> PlanCheckpointFiles(const std::vector<WriteEntry>& entries, uint64_t max_shard_bytes);
// model.safetensors.index.json for those files (metadata.total_size and weight_map), written atomically.
void WriteCheckpointIndex(const std::string& dir, const std::vector<CheckpointFile>& files);
// A small text file (config.json, an index) written to a temp name, fsynced and renamed into place.
void WriteSmallFileAtomically(const std::string& path, const std::string& text);

// Writes entries as a checkpoint directory. With max_shard_bytes, files are
// model-00001-of-0000N.safetensors and model.safetensors.index.json is written last; all files are
// renamed into place only once every one is complete.
WrittenCheckpoint WriteCheckpoint(const std::string& dir, const std::vector<WriteEntry>& entries,
                                  const DataSource& source, const CheckpointWriteOptions& options = {});

}  // namespace shardcast
