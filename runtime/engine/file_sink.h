// runtime/engine/file_sink: the file side of a save. FileSink is the Sink that writes a stream's bytes into
// the output files at their final offsets; OutputDir is what rank 0 does to the directory around it.
//
//   out_dir.tmp-<id>/                 created by rank 0: every file at its final size, header written
//     model-00001-of-00002.safetensors   |header|  rows of rank 0 | rows of rank 1 | ...  (pwrite)
//     model-00002-of-00002.safetensors   |header|  ...
//     model.safetensors.index.json, config.json, generation_config.json   (rank 0, after every write)
//   rename(out_dir.tmp-<id>, out_dir)     or renameat2(RENAME_EXCHANGE) over an existing out_dir
//
// A segment's source_offset is the absolute byte offset of its elements in its part's output file,
// source_bytes their size in the file's dtype; target bytes (the local tensor's dtype) are converted
// to the file's dtype on the way out when the two differ.
//
// Thread safety: a FileSink is driven by the stream's one thread. OutputDir functions are for rank 0.
// Failure: kIo naming the file, the byte range, the rank and the errno (ENOSPC, EFBIG, EIO, ...).
#pragma once

#include <string>
#include <vector>

#include "allocators/scratch_buffer.h"
#include "runtime/engine/sink.h"
#include "runtime/stream/source.h"

namespace shardcast {

class FileSink : public Sink {
 public:
  // `dir` holds the manifest's files (by their names). Nothing is opened until Open.
  FileSink(const Manifest& m, const std::string& dir, int rank);
  ~FileSink() override;
  FileSink(const FileSink&) = delete;
  FileSink& operator=(const FileSink&) = delete;

  // Opens every file write-only and checks it is a regular file of the manifest's size (a rank that
  // does not see rank 0's directory, or sees another one, fails here, before any data).
  void Open();
  unsigned char* HostDirect(const Segment&) override { return nullptr; }
  void Store(const Segment& s, const unsigned char* data) override;
  // fdatasync of exactly the files this rank wrote, then closes every file.
  void Sync();
  uint64_t bytes_written() const { return bytes_written_; }
  uint64_t files_written() const;

 private:
  const std::string& PathOf(uint32_t file) const { return paths_[file]; }
  const Manifest& m_;
  std::vector<std::string> paths_;  // dir/name, by manifest file index
  int rank_;
  std::vector<int> fds_;
  std::vector<bool> written_;
  ScratchBuffer scratch_;
  uint64_t bytes_written_ = 0;
};

namespace output_dir {

// A save's hold on the directory it builds: an flock on the directory, which Create takes before the
// directory has its name (made hidden, locked, renamed in) and which is released when the hold is destroyed
// (the save ended, committed or not). Leftovers() passes
// over a build that is held, so a save never removes the build of another save still writing into the
// same out_dir (two jobs, every rank with dcp.save(no_dist=True), an async save still running). Best
// effort: where the filesystem refuses flock on a directory nothing is held, and every ".tmp-" entry
// counts as left over, as before. Move-only; not thread-safe.
class BuildHold {
 public:
  BuildHold() = default;
  explicit BuildHold(const std::string& dir);
  ~BuildHold();
  BuildHold(BuildHold&& other) noexcept;
  BuildHold& operator=(BuildHold&& other) noexcept;
  BuildHold(const BuildHold&) = delete;
  BuildHold& operator=(const BuildHold&) = delete;

 private:
  int fd_ = -1;
};
// Whether a BuildHold (of this process or another) is on `dir` now.
bool Held(const std::string& dir);

// "<parent>/<name>.tmp-*" entries beside out_dir, left by saves and converts that did not finish (not
// one a running save holds), "<parent>/<name>.old-*" ones, left by a convert of an earlier version
// killed during its swap, and "<parent>/.<name>.tmp-*.making" ones over a minute old, left by a save killed
// while it made its build (between mkdir and rename: Create).
std::vector<std::string> Leftovers(const std::string& out_dir);
// Rank 0's check before a save: an out_dir that exists (a directory) or leftovers are a kInvalidArgument
// naming them all, unless overwrite; returns the leftovers (for overwrite to remove).
std::vector<std::string> Check(const std::string& out_dir, bool overwrite);
// Removes a directory tree; best effort, never throws.
void RemoveTree(const std::string& path);
// Creates `dir` (and missing parents of it) and holds it, then each file with its header, allocated at
// its final size so that a full disk fails here, before any data moves; fsyncs files and directory.
// Returns the hold, for the caller to keep until the save ends.
BuildHold Create(const std::string& dir, const std::vector<ManifestFile>& files,
                 const std::vector<std::string>& headers);
// Writes a small file in `dir` and fsyncs it.
void WriteText(const std::string& dir, const std::string& name, const std::string& text);
// Carries what an existing `from` holds into `to`, for a save that keeps the other files of the
// out_dir it replaces: every name `to` does not have, except *.safetensors files and
// model.safetensors.index.json at the top (the checkpoint being replaced); folders are recreated,
// files hard-linked (copied where linking fails), symlinks copied as links; fsyncs `to`. Nothing when
// `from` does not exist. Failure: kIo naming the path.
void CarryOver(const std::string& from, const std::string& to);
// Puts `tmp` in place as `out_dir` atomically: rename when out_dir does not exist, else (overwrite)
// exchange the two and remove the old tree, now at `tmp`; fsyncs the parent. No instant shows a
// partial out_dir.
void Commit(const std::string& tmp, const std::string& out_dir);

}  // namespace output_dir
}  // namespace shardcast
