#include "runtime/engine/file_sink.h"

#include <dirent.h>
#include <fcntl.h>
#include <linux/fs.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <ctime>
#include <filesystem>
#include <string>

#include "allocators/error.h"
#include "loaders/checkpoint.h"
#include "runtime/agree/fault.h"

namespace shardcast {
namespace {

std::string Range(uint64_t offset, uint64_t n) {
  return "bytes [" + std::to_string(offset) + ", " + std::to_string(offset + n) + ")";
}

// Writes all of [data, data + n) at `offset`, through EINTR and short writes.
// `key`, when given, names the tensor in the error.
void PwriteAll(int fd, const unsigned char* data, uint64_t n, uint64_t offset, const std::string& path,
               std::string_view key = {}) {
  uint64_t done = 0;
  while (done < n) {
    const ssize_t w = ::pwrite(fd, data + done, n - done, static_cast<off_t>(offset + done));
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) {
      const int err = w < 0 ? errno : EIO;
      throw Error(ErrorKind::kIo, "writing " + path + (key.empty() ? "" : " (tensor '" + std::string(key) + "')"),
                  "cannot write " + Range(offset + done, n - done) + ": " + ErrnoText(err));
    }
    done += static_cast<uint64_t>(w);
  }
}

[[noreturn]] void Fail(const std::string& path, const std::string& what, int err) {
  throw Error(ErrorKind::kIo, path, what + ": " + ErrnoText(err));
}

void FsyncPath(const std::string& path, bool directory) {
  const int fd = ::open(path.c_str(), (directory ? O_RDONLY | O_DIRECTORY : O_RDONLY) | O_CLOEXEC);
  if (fd < 0) Fail(path, "cannot open to fsync", errno);
  const int rc = ::fsync(fd);
  const int err = errno;
  ::close(fd);
  if (rc != 0 && !(directory && (err == EINVAL || err == EROFS))) Fail(path, "fsync", err);
}

std::string Parent(const std::string& path) {
  const std::string p = std::filesystem::path(path).parent_path().string();
  return p.empty() ? "." : p;
}

// Gives the file its final size with real blocks where the filesystem can (a full disk fails now),
// else as a sparse file.
void Allocate(int fd, uint64_t size, const std::string& path) {
  int rc = ::fallocate(fd, 0, 0, static_cast<off_t>(size));
  if (rc == 0) return;
  const int err = errno;
  if (err != EOPNOTSUPP && err != ENOSYS && err != EINVAL) {
    Fail(path, "cannot allocate " + std::to_string(size) + " bytes (the final size)", err);
  }
  if (::ftruncate(fd, static_cast<off_t>(size)) != 0) {
    Fail(path, "cannot extend to " + std::to_string(size) + " bytes", errno);
  }
}

}  // namespace

FileSink::FileSink(const Manifest& m, const std::string& dir, int rank)
    : m_(m), rank_(rank), fds_(m.files.size(), -1), written_(m.files.size(), false) {
  for (const ManifestFile& f : m.files) paths_.push_back(dir + "/" + f.name);
}

FileSink::~FileSink() {
  for (int fd : fds_) {
    if (fd >= 0) ::close(fd);
  }
}

void FileSink::Open() {
  for (uint32_t i = 0; i < m_.files.size(); ++i) {
    const std::string& path = PathOf(i);
    const int fd = ::open(path.c_str(), O_WRONLY | O_CLOEXEC | O_NOFOLLOW);
    if (fd < 0) {
      const int err = errno;
      throw Error(ErrorKind::kIo, path,
                  "cannot open the file rank 0 created: " + ErrnoText(err) +
                      (err == ENOENT ? " (mode each-rank needs one filesystem that every rank sees at the same "
                                       "path; use mode rank0 for node-local disks)"
                                     : ""));
    }
    fds_[i] = fd;
    struct stat st {};
    if (::fstat(fd, &st) != 0) Fail(path, "fstat", errno);
    if (!S_ISREG(st.st_mode) || static_cast<uint64_t>(st.st_size) != m_.files[i].size) {
      throw Error(ErrorKind::kIo, path,
                  std::to_string(st.st_size) + " bytes here but rank 0 created it with " +
                      std::to_string(m_.files[i].size) + " (not the same file on every rank)");
    }
  }
}

void FileSink::Store(const Segment& s, const unsigned char* data) {
  FaultPoint("save-write", rank_);
  const ManifestEntry& e = m_.entries[s.entry];
  const ManifestPart& p = e.parts[s.part];
  const unsigned char* bytes = data;
  if (p.source_dtype != e.target_dtype) {  // the file's dtype differs from the shard's: convert
    unsigned char* out = scratch_.Get(s.source_bytes);
    ConvertElements(e.target_dtype, p.source_dtype, data, out, s.runs * s.count);
    bytes = out;
  }
  if (fds_[p.file] < 0) throw Error(ErrorKind::kInternal, PathOf(p.file), "written before it was opened");
  if (s.source_contiguous()) {
    PwriteAll(fds_[p.file], bytes, s.source_bytes, s.source_offset, PathOf(p.file), p.checkpoint_key);
  } else {  // a strided window: each run at its place in the tensor
    const uint64_t ss = DTypeSize(p.source_dtype), run = s.count * ss;
    for (uint64_t i = 0; i < s.runs; ++i) {
      PwriteAll(fds_[p.file], bytes + i * run, run, s.source_offset + i * s.stride * ss, PathOf(p.file),
                p.checkpoint_key);
    }
  }
  written_[p.file] = true;
  bytes_written_ += s.source_bytes;
}

void FileSink::Sync() {
  for (uint32_t i = 0; i < fds_.size(); ++i) {
    if (fds_[i] < 0) continue;
    if (written_[i] && ::fdatasync(fds_[i]) != 0) {
      throw Error(ErrorKind::kIo, PathOf(i), "fdatasync: " + ErrnoText(errno));
    }
    ::close(fds_[i]);
    fds_[i] = -1;
  }
}

uint64_t FileSink::files_written() const {
  uint64_t n = 0;
  for (bool w : written_) n += w;
  return n;
}

namespace output_dir {

BuildHold::BuildHold(const std::string& dir) {
  fd_ = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd_ < 0) return;
  // Blocking: the only other lockers of a directory just made are Held()'s probes, which let go at once. A
  // non-blocking lock lost to a probe held nothing, and the prober then removed this live build.
  int rc;
  do {
    rc = ::flock(fd_, LOCK_EX);
  } while (rc != 0 && errno == EINTR);
  if (rc != 0) {  // no flock here: hold nothing, as before
    ::close(fd_);
    fd_ = -1;
  }
}

BuildHold::~BuildHold() {
  if (fd_ >= 0) ::close(fd_);  // releases the flock
}

BuildHold::BuildHold(BuildHold&& other) noexcept : fd_(other.fd_) { other.fd_ = -1; }

BuildHold& BuildHold::operator=(BuildHold&& other) noexcept {
  if (this != &other) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = other.fd_;
    other.fd_ = -1;
  }
  return *this;
}

// Makes `dir` held from its first instant: made under a name no save looks at, locked, then renamed into
// place (the directory, and the flock on it, stay the same). Made where it stands, then locked, another save's
// Leftovers() could find it unheld between the two, and remove it.
//
//   mkdir  <parent>/.<name>.making        flock it        renameat2(RENAME_NOREPLACE) -> <parent>/<name>
namespace {
BuildHold MakeHeld(const std::string& dir) {
  const std::string making = Parent(dir) + "/." + std::filesystem::path(dir).filename().string() + ".making";
  if (::mkdir(making.c_str(), 0755) != 0) Fail(making, "cannot create the save's directory", errno);
  BuildHold hold(making);
  if (::syscall(SYS_renameat2, AT_FDCWD, making.c_str(), AT_FDCWD, dir.c_str(), RENAME_NOREPLACE) == 0) return hold;
  int err = errno;
  if (err == EINVAL || err == ENOSYS) {  // no RENAME_NOREPLACE here: a plain rename, refusing what is there
    struct stat st {};
    err = ::lstat(dir.c_str(), &st) == 0 ? EEXIST : (::rename(making.c_str(), dir.c_str()) == 0 ? 0 : errno);
    if (err == 0) return hold;
  }
  ::rmdir(making.c_str());
  Fail(dir, "cannot create the save's directory", err);
}
}  // namespace

bool Held(const std::string& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return false;
  const bool held = ::flock(fd, LOCK_EX | LOCK_NB) != 0 && errno == EWOULDBLOCK;
  ::close(fd);  // releases the flock this check may have taken
  return held;
}

namespace {
// A build killed between its mkdir and its rename keeps its hidden name (".<name>.tmp-*.making", MakeHeld). A
// live save holds that name for the microseconds between mkdir and flock, unheld, so only one older than this
// counts as left over: a sweep never races a save that is being made.
constexpr int kMakingStaleSeconds = 60;

bool Stale(const std::string& path) {
  struct stat st {};
  return ::lstat(path.c_str(), &st) == 0 && ::time(nullptr) - st.st_mtime > kMakingStaleSeconds;
}

bool HasSuffix(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}
}  // namespace

std::vector<std::string> Leftovers(const std::string& out_dir) {
  std::vector<std::string> out;
  const std::filesystem::path p(out_dir);
  const std::string tmp = p.filename().string() + ".tmp-", old = p.filename().string() + ".old-",
                    making = "." + tmp, parent = Parent(out_dir);
  DIR* d = ::opendir(parent.c_str());
  if (d == nullptr) return out;
  while (const dirent* e = ::readdir(d)) {
    const std::string name = e->d_name, path = parent + "/" + name;
    const bool ours = name.compare(0, tmp.size(), tmp) == 0 || name.compare(0, old.size(), old) == 0 ||
                      (name.compare(0, making.size(), making) == 0 && HasSuffix(name, ".making") && Stale(path));
    if (ours && !Held(path)) out.push_back(path);
  }
  ::closedir(d);
  std::sort(out.begin(), out.end());
  return out;
}

std::vector<std::string> Check(const std::string& out_dir, bool overwrite) {
  struct stat st {};
  const bool exists = ::stat(out_dir.c_str(), &st) == 0;
  if (exists && !S_ISDIR(st.st_mode)) {
    throw Error(ErrorKind::kInvalidArgument, out_dir, "exists and is not a directory");
  }
  std::vector<std::string> left = Leftovers(out_dir);
  if (!overwrite && (exists || !left.empty())) {  // both named at once, if both are there
    std::string why = exists ? out_dir + ": exists (pass overwrite=True to replace it)" : "";
    if (!left.empty()) {
      why += (exists ? "; and " : "") + left.front() +
             (left.size() > 1 ? " (and " + std::to_string(left.size() - 1) + " more)" : "") +
             ": left by a save or convert that did not finish (a rank died or was killed); remove it, or pass overwrite=True";
    }
    throw Error(ErrorKind::kInvalidArgument, "", why);
  }
  return left;
}

void RemoveTree(const std::string& path) {
  std::error_code ec;
  std::filesystem::remove_all(path, ec);
}

BuildHold Create(const std::string& dir, const std::vector<ManifestFile>& files,
                 const std::vector<std::string>& headers) {
  std::error_code ec;
  std::filesystem::create_directories(Parent(dir), ec);
  BuildHold hold = MakeHeld(dir);
  for (size_t i = 0; i < files.size(); ++i) {
    const std::string path = dir + "/" + files[i].name;
    const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
    if (fd < 0) Fail(path, "cannot create", errno);
    try {
      PwriteAll(fd, reinterpret_cast<const unsigned char*>(headers[i].data()), headers[i].size(), 0, path);
      Allocate(fd, files[i].size, path);
      if (::fsync(fd) != 0) Fail(path, "fsync", errno);
    } catch (...) {
      ::close(fd);
      throw;
    }
    ::close(fd);
  }
  FsyncPath(dir, true);
  return hold;
}

void WriteText(const std::string& dir, const std::string& name, const std::string& text) {
  const std::string path = dir + "/" + name;
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) Fail(path, "cannot create", errno);
  try {
    PwriteAll(fd, reinterpret_cast<const unsigned char*>(text.data()), text.size(), 0, path);
    if (::fsync(fd) != 0) Fail(path, "fsync", errno);
  } catch (...) {
    ::close(fd);
    throw;
  }
  ::close(fd);
}

namespace {

// `from` (a folder) into `to` (created): files hard-linked or copied, links as links, folders recursively.
void LinkTree(const std::filesystem::path& from, const std::filesystem::path& to, bool top) {
  namespace fs = std::filesystem;
  std::error_code ec;
  fs::directory_iterator listing(from, ec);
  if (ec) Fail(from.string(), "cannot list the folder to keep its files", ec.value());
  for (const fs::directory_entry& e : listing) {
    const std::string name = e.path().filename().string();
    const fs::path dest = to / name;
    if (fs::symlink_status(dest, ec).type() != fs::file_type::not_found) continue;  // written by this save
    const fs::file_status st = e.symlink_status(ec);
    // The old model's files are replaced, not kept: its index and its model.safetensors or
    // model-NNNNN-of-NNNNN.safetensors (a stale shard of another count would linger), files or symlinks
    // (a hub cache's snapshot links into blobs/). Any other safetensors file (an adapter, a training
    // state's rank files) is the user's and stays, as torch's writers leave it.
    if (top && (fs::is_regular_file(st) || fs::is_symlink(st)) &&
        (name == kIndexFileName || IsModelFileName(name))) {
      continue;
    }
    if (fs::is_symlink(st)) {
      fs::copy_symlink(e.path(), dest, ec);
    } else if (fs::is_directory(st)) {
      if (!fs::create_directory(dest, ec) && ec) Fail(dest.string(), "cannot create the folder kept from " + e.path().string(), ec.value());
      LinkTree(e.path(), dest, false);
      FsyncPath(dest.string(), true);
      continue;
    } else if (fs::is_regular_file(st)) {
      if (::link(e.path().c_str(), dest.c_str()) == 0) continue;
      fs::copy_file(e.path(), dest, ec);
      if (!ec) FsyncPath(dest.string(), false);
    } else {
      continue;  // sockets, fifos: nothing a checkpoint holds
    }
    if (ec) Fail(dest.string(), "cannot carry over " + e.path().string(), ec.value());
  }
}

}  // namespace

void CarryOver(const std::string& from, const std::string& to) {
  struct stat st {};
  if (::stat(from.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) return;
  LinkTree(from, to, true);
  FsyncPath(to, true);
}

void Commit(const std::string& tmp, const std::string& out_dir) {
  FsyncPath(tmp, true);
  if (::rename(tmp.c_str(), out_dir.c_str()) == 0) {  // out_dir did not exist (or was an empty directory)
    FsyncPath(Parent(out_dir), true);
    return;
  }
  if (errno != EEXIST && errno != ENOTEMPTY) Fail(out_dir, "cannot rename " + tmp + " into place", errno);
  // An existing out_dir (overwrite): swap the two in one step, then remove the old tree.
  if (::syscall(SYS_renameat2, AT_FDCWD, tmp.c_str(), AT_FDCWD, out_dir.c_str(), RENAME_EXCHANGE) != 0) {
    if (errno != EINVAL && errno != ENOSYS) Fail(out_dir, "cannot exchange it with " + tmp, errno);
    // No RENAME_EXCHANGE on this filesystem: move the old one aside first (for an instant there is no
    // out_dir, never a partial one; a kill here leaves the old tree under a .tmp- name, named next time).
    const std::string old = tmp + "-old";
    if (::rename(out_dir.c_str(), old.c_str()) != 0) Fail(out_dir, "cannot move it aside to " + old, errno);
    if (::rename(tmp.c_str(), out_dir.c_str()) != 0) Fail(out_dir, "cannot rename " + tmp + " into place", errno);
    FsyncPath(Parent(out_dir), true);
    RemoveTree(old);
    return;
  }
  FsyncPath(Parent(out_dir), true);
  RemoveTree(tmp);  // the old out_dir
}

}  // namespace output_dir
}  // namespace shardcast
