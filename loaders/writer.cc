#include "loaders/writer.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <algorithm>
#include <cstdio>
#include <memory>
#include <nlohmann/json.hpp>

#include "allocators/error.h"

namespace shardcast {
namespace {

[[noreturn]] void FailIo(const std::string& path, const std::string& what, int err) {
  throw Error(ErrorKind::kIo, path, what + ": " + ErrnoText(err));
}

void WriteAll(int fd, const std::string& path, const void* data, size_t n) {
  const auto* p = static_cast<const unsigned char*>(data);
  while (n > 0) {
    ssize_t w = ::write(fd, p, n);
    if (w < 0) {
      if (errno == EINTR) continue;
      FailIo(path, "write", errno);
    }
    p += w;
    n -= static_cast<size_t>(w);
  }
}

std::string DirName(const std::string& path) {
  auto slash = path.rfind('/');
  return slash == std::string::npos ? "." : slash == 0 ? "/" : path.substr(0, slash);
}

void FsyncDir(const std::string& dir) {
  int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return;  // best effort: some filesystems refuse directory fds
  fsync(fd);
  ::close(fd);
}

}  // namespace

void WriteSmallFileAtomically(const std::string& path, const std::string& text) {
  std::string tmp = path + ".tmp-" + std::to_string(getpid());
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) FailIo(tmp, "cannot create", errno);
  try {
    WriteAll(fd, tmp, text.data(), text.size());
    if (fsync(fd) != 0) FailIo(tmp, "fsync", errno);
  } catch (...) {
    ::close(fd);
    unlink(tmp.c_str());
    throw;
  }
  ::close(fd);
  if (rename(tmp.c_str(), path.c_str()) != 0) {
    int err = errno;
    unlink(tmp.c_str());
    FailIo(path, "rename from " + tmp, err);
  }
  FsyncDir(DirName(path));
}


uint64_t WriteEntry::nbytes() const {
  uint64_t n = DTypeSize(dtype);
  for (uint64_t d : shape) {
    if (__builtin_mul_overflow(n, d, &n)) {
      throw Error(ErrorKind::kInvalidArgument, key, "shape product overflows 64 bits");
    }
  }
  return n;
}

std::string BuildHeader(const std::vector<WriteEntry>& entries, const Metadata& metadata) {
  nlohmann::ordered_json h = nlohmann::ordered_json::object();
  if (!metadata.empty()) {
    auto& m = h["__metadata__"] = nlohmann::ordered_json::object();
    for (const auto& [k, v] : metadata) m[k] = v;
  }
  uint64_t offset = 0;
  for (const auto& e : entries) {
    if (e.key == "__metadata__" || h.contains(e.key)) {
      throw Error(ErrorKind::kInvalidArgument, e.key, "duplicate or reserved key in a safetensors file");
    }
    uint64_t n = e.nbytes();
    h[e.key] = {{"dtype", std::string(DTypeName(e.dtype))}, {"shape", e.shape}, {"data_offsets", {offset, offset + n}}};
    offset += n;
  }
  std::string json = h.dump();
  json.append((8 - json.size() % 8) % 8, ' ');  // data area starts 8-byte aligned
  std::string out(8, '\0');
  uint64_t n = json.size();
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((n >> (8 * i)) & 0xff);
  return out + json;
}

SafetensorsWriter::SafetensorsWriter(std::string path, std::vector<WriteEntry> entries, const Metadata& metadata)
    : path_(std::move(path)) {
  std::string header = BuildHeader(entries, metadata);
  header_bytes_ = header.size();
  for (const auto& e : entries) data_bytes_ += e.nbytes();
  tmp_path_ = path_ + ".tmp-" + std::to_string(getpid());
  fd_ = ::open(tmp_path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd_ < 0) FailIo(tmp_path_, "cannot create", errno);
  WriteAll(fd_, tmp_path_, header.data(), header.size());
}

SafetensorsWriter::~SafetensorsWriter() {
  if (fd_ >= 0) ::close(fd_);
  if (!published_) unlink(tmp_path_.c_str());
}

void SafetensorsWriter::Append(const void* data, size_t n) {
  if (finished_ || written_ + n > data_bytes_) {
    throw Error(ErrorKind::kInvalidArgument, path_,
                "append of " + std::to_string(n) + " bytes past the declared data area of " +
                    std::to_string(data_bytes_) + " bytes");
  }
  WriteAll(fd_, tmp_path_, data, n);
  written_ += n;
}

void SafetensorsWriter::AppendHole() {
  if (written_ != 0 || finished_) throw Error(ErrorKind::kInvalidArgument, path_, "hole after data");
  if (ftruncate(fd_, static_cast<off_t>(header_bytes_ + data_bytes_)) != 0) FailIo(tmp_path_, "ftruncate", errno);
  written_ = data_bytes_;
}

void SafetensorsWriter::Finish() {
  if (finished_) return;
  if (written_ != data_bytes_) {
    throw Error(ErrorKind::kInvalidArgument, path_,
                "commit after " + std::to_string(written_) + " of " + std::to_string(data_bytes_) + " data bytes");
  }
  if (fsync(fd_) != 0) FailIo(tmp_path_, "fsync", errno);
  if (::close(fd_) != 0) FailIo(tmp_path_, "close", errno);
  fd_ = -1;
  finished_ = true;
}

void SafetensorsWriter::Publish() {
  if (published_) return;
  if (!finished_) throw Error(ErrorKind::kInternal, path_, "Publish before Finish");
  if (rename(tmp_path_.c_str(), path_.c_str()) != 0) FailIo(path_, "rename from " + tmp_path_, errno);
  published_ = true;
  FsyncDir(DirName(path_));
}

void SafetensorsWriter::Commit() {
  Finish();
  Publish();
}

std::vector<CheckpointFile> PlanCheckpointFiles(const std::vector<WriteEntry>& entries, uint64_t max_shard_bytes) {
  std::vector<CheckpointFile> files(1);
  for (const auto& e : entries) {
    const uint64_t n = e.nbytes();
    if (max_shard_bytes > 0 && !files.back().entries.empty() && files.back().data_bytes + n > max_shard_bytes) {
      files.emplace_back();
    }
    files.back().entries.push_back(e);
    files.back().data_bytes += n;
  }
  for (size_t g = 0; g < files.size(); ++g) {
    char name[64];
    if (max_shard_bytes > 0) {
      std::snprintf(name, sizeof(name), "model-%05zu-of-%05zu.safetensors", g + 1, files.size());
    } else {
      std::snprintf(name, sizeof(name), "%s", "model.safetensors");
    }
    files[g].name = name;
  }
  return files;
}

void WriteCheckpointIndex(const std::string& dir, const std::vector<CheckpointFile>& files) {
  nlohmann::ordered_json weight_map = nlohmann::ordered_json::object();
  uint64_t total = 0;
  for (const auto& f : files) {
    for (const auto& e : f.entries) weight_map[e.key] = f.name;
    total += f.data_bytes;
  }
  nlohmann::ordered_json index = {{"metadata", {{"total_size", total}}}, {"weight_map", weight_map}};
  WriteSmallFileAtomically(dir + "/" + "model.safetensors.index.json", index.dump(2) + "\n");
}

WrittenCheckpoint WriteCheckpoint(const std::string& dir, const std::vector<WriteEntry>& entries,
                                  const DataSource& source, const CheckpointWriteOptions& options) {
  if (mkdir(dir.c_str(), 0755) != 0 && errno != EEXIST) FailIo(dir, "cannot create directory", errno);
  const std::vector<CheckpointFile> files = PlanCheckpointFiles(entries, options.max_shard_bytes);
  WrittenCheckpoint out;
  std::vector<std::unique_ptr<SafetensorsWriter>> writers;
  std::vector<unsigned char> buf(options.sparse ? 0 : options.chunk_bytes);
  for (const CheckpointFile& f : files) {
    auto w = std::make_unique<SafetensorsWriter>(dir + "/" + f.name, f.entries, options.metadata);
    if (options.sparse) {
      w->AppendHole();
    } else {
      for (const auto& e : f.entries) {
        uint64_t total = e.nbytes();
        for (uint64_t off = 0; off < total; off += buf.size()) {
          size_t n = static_cast<size_t>(std::min<uint64_t>(buf.size(), total - off));
          source(e, off, buf.data(), n);
          w->Append(buf.data(), n);
        }
      }
    }
    w->Finish();
    out.files.push_back(dir + "/" + f.name);
    out.total_bytes += w->data_bytes();
    writers.push_back(std::move(w));
  }
  for (auto& w : writers) w->Publish();
  if (options.max_shard_bytes > 0) WriteCheckpointIndex(dir, files);
  return out;
}

}  // namespace shardcast
