// loaders/safetensors_file: one validated safetensors file, memory-mapped read-only or read by pread.
//
// Open() validates the whole header (see safetensors_header.h) before it returns, so every TensorInfo
// handed out is in bounds. Views are zero-copy and valid while the SafetensorsFile lives.
// The file is opened once; what it is (a regular file), its size and every byte read come from that
// one descriptor, so a name swapped afterwards changes nothing. Every read is bounds-checked
// against file_size().
//
// Thread safety: after Open, every const method may be called from any thread concurrently.
// Failure: every method throws shardcast::Error; kCheckpoint for bad or changed files (naming the
// file, key and byte range), kIo when the OS refuses. A file truncated after Open is an Error from
// ReadRows/ReadBytes, never SIGBUS: copies out of the mapping run under a fault guard.
#pragma once

#include <sys/types.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

#include "loaders/safetensors_header.h"

namespace shardcast {

enum class ReadMode {
  kMmap,   // default: map the file read-only; views are zero-copy
  kPread,  // no mapping: for filesystems where mmap is slow (NFS, Lustre); View() is unavailable
};

struct OpenOptions {
  ReadMode mode = ReadMode::kMmap;  // default kMmap
  bool sequential_hint = true;      // default true: madvise/fadvise SEQUENTIAL for streaming
  // The digest of a header another process has already parsed and validated (rank 0's, from the
  // manifest). A header with this digest is taken as known and not parsed again (header() is then
  // empty: the caller addresses bytes by the offsets that process resolved, each read still checked
  // against file_size()); any other header is parsed and validated in full. 0: always parse.
  uint64_t known_header_digest = 0;
};

// What ReleasePages drops.
enum class Release {
  kMapping,            // default: unmap the pages from this process (RssFile falls); page cache stays warm
  kMappingAndCache,    // also ask the kernel to drop them from the page cache (POSIX_FADV_DONTNEED)
};

struct ByteSpan {
  const unsigned char* data = nullptr;
  uint64_t size = 0;
};

class SafetensorsFile {
 public:
  // Opens `path` once (without blocking on a FIFO), checks through the descriptor that it is a
  // regular file, takes its size from fstat, and validates the header. Same as
  // OpenAt(AT_FDCWD, path, path, options).
  static std::unique_ptr<SafetensorsFile> Open(const std::string& path, const OpenOptions& options = {});
  // Opens `name` relative to the directory `dirfd` (symlinks are followed), exactly once; errors and
  // path() say `display_path`. From then on only that descriptor is used: the header read, the
  // mapping and every pread. A name that is not a regular file (FIFO, socket, device, directory) is
  // kCheckpoint naming display_path and what it is; a missing one is kIo.
  static std::unique_ptr<SafetensorsFile> OpenAt(int dirfd, const std::string& name,
                                                 const std::string& display_path, const OpenOptions& options = {});
  // Takes ownership of `fd` (an open, readable descriptor; closed here on failure too) and does what
  // OpenAt does after its open: fstat, the regular-file check, the header, the mapping.
  static std::unique_ptr<SafetensorsFile> FromDescriptor(int fd, const std::string& display_path,
                                                         const OpenOptions& options = {});
  ~SafetensorsFile();
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  const std::string& path() const { return path_; }
  const Header& header() const { return header_; }
  uint64_t file_size() const { return file_size_; }  // what fstat said at open; every read is checked against it
  ReadMode mode() const { return mode_; }
  // XXH3-64 of the 8-byte length prefix and the header JSON, computed once at open: with path() and
  // file_size() it is what ranks compare to agree they hold the same file before any read.
  uint64_t header_digest() const { return header_digest_; }
  // XXH3-64 of three samples of the data area (the bytes after the header): its first, middle and last
  // kSampleBytes, or all of it where it is smaller. With header_digest() it tells apart two files with the
  // same tensors but other values (another step of the same run, a copy with other weights), which the
  // header alone does not. Reads them (ReadBytes: a file that shrank throws kCheckpoint); not cached.
  static constexpr uint64_t kSampleBytes = 4096;
  uint64_t SampleDigest() const;

  // By key, never by position. Find returns nullptr if absent; Get throws naming the file and key.
  const TensorInfo* Find(std::string_view key) const { return header_.Find(key); }
  const TensorInfo& Get(std::string_view key) const;

  // File-absolute offset of rows [r0, r1) of dim 0. REQUIRES: r0 <= r1 <= t.rows() (else throws).
  uint64_t RowOffset(const TensorInfo& t, uint64_t r0) const;
  uint64_t RowRangeBytes(const TensorInfo& t, uint64_t r0, uint64_t r1) const;

  // Zero-copy views into the mapping. REQUIRES: mode() == kMmap. Touching a view of a file that was
  // truncated after Open raises SIGBUS like any mapping; use ReadRows where that must be an error.
  ByteSpan View(const TensorInfo& t) const;
  ByteSpan RowRange(const TensorInfo& t, uint64_t r0, uint64_t r1) const;

  // Copies rows [r0, r1) of t into dst (no alignment needed). Checks the file has not shrunk.
  void ReadRows(const TensorInfo& t, uint64_t r0, uint64_t r1, void* dst) const;
  // Copies file bytes [offset, offset + n) into dst; `what` names them in errors. A range not inside
  // [0, file_size()) (overflow-checked) throws kCheckpoint naming the file, the range, the size and
  // `what`, and copies nothing.
  void ReadBytes(uint64_t offset, uint64_t n, void* dst, std::string_view what) const;

  // Asks the kernel to start reading file bytes [offset, offset + n) in the background (read-ahead
  // for a stream that will need them soon). Best effort: never blocks on the read, never throws.
  void Prefetch(uint64_t offset, uint64_t n) const;

  // Gives back the pages of file bytes [offset, offset + n) that the caller has consumed. The range
  // is checked like ReadBytes's: one outside the file throws kCheckpoint and releases nothing.
  void ReleasePages(uint64_t offset, uint64_t n, Release how = Release::kMapping) const;

 private:
  SafetensorsFile() = default;
  void CheckRows(const TensorInfo& t, uint64_t r0, uint64_t r1) const;
  void CheckInFile(uint64_t offset, uint64_t n, std::string_view what) const;

  std::string path_;
  int fd_ = -1;
  const unsigned char* map_ = nullptr;
  uint64_t file_size_ = 0;
  dev_t dev_ = 0;  // the device it lives on: its read-ahead limit
  uint64_t header_digest_ = 0;
  uint64_t data_offset_ = 0;  // 8 + the header's length, known without parsing the header
  ReadMode mode_ = ReadMode::kMmap;
  Header header_;
};

// Copies n bytes from a file mapping; a SIGBUS inside [src, src + n) (the file shrank) returns false
// instead of killing the process. Thread-safe; the guard is per thread.
bool GuardedCopy(void* dst, const void* src, size_t n);

}  // namespace shardcast
