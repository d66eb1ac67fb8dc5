#include "loaders/posix_file.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>

#include "allocators/error.h"
#include "loaders/safetensors_header.h"

namespace shardcast {

UniqueFd& UniqueFd::operator=(UniqueFd&& o) noexcept {
  if (this != &o) {
    reset();
    fd_ = o.release();
  }
  return *this;
}

void UniqueFd::reset() {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
}

const char* FileKindText(mode_t mode) {
  if (S_ISREG(mode)) return "a regular file";
  if (S_ISDIR(mode)) return "a directory";
  if (S_ISFIFO(mode)) return "a FIFO";
  if (S_ISSOCK(mode)) return "a socket";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  if (S_ISLNK(mode)) return "a symbolic link";
  return "an unknown kind of file";
}

std::optional<OpenNode> OpenNodeAt(int dirfd, const std::string& name, const std::string& display_path) {
  OpenNode node;
  int fd;
  do {
    fd = ::openat(dirfd, name.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC | O_NOCTTY);
  } while (fd < 0 && errno == EINTR);
  if (fd < 0) {
    const int err = errno;
    if (err == ENOENT || err == ENOTDIR) return std::nullopt;
    // open() of a Unix socket fails with ENXIO; say what the name is rather than quoting errno. This
    // lookup only chooses the words of the message; nothing is read through it.
    struct stat st;
    if (err == ENXIO && fstatat(dirfd, name.c_str(), &st, 0) == 0 && !S_ISREG(st.st_mode)) {
      throw Error(ErrorKind::kCheckpoint, display_path,
                  std::string("is ") + FileKindText(st.st_mode) + ", not a regular file");
    }
    throw Error(ErrorKind::kIo, display_path, "cannot open: " + ErrnoText(err));
  }
  node.fd = UniqueFd(fd);
  if (fstat(fd, &node.st) != 0) throw Error(ErrorKind::kIo, display_path, "cannot stat: " + ErrnoText(errno));
  const int flags = fcntl(fd, F_GETFL);
  if (flags < 0 || fcntl(fd, F_SETFL, flags & ~O_NONBLOCK) != 0) {
    throw Error(ErrorKind::kIo, display_path, "cannot clear O_NONBLOCK: " + ErrnoText(errno));
  }
  return node;
}

void RequireRegularFile(mode_t mode, const std::string& display_path) {
  if (!S_ISREG(mode)) {
    throw Error(ErrorKind::kCheckpoint, display_path, std::string("is ") + FileKindText(mode) + ", not a regular file");
  }
}

std::string ReadWholeFile(int fd, uint64_t size, const std::string& display_path) {
  std::string out(size, '\0');
  uint64_t done = 0;
  while (done < size) {
    ssize_t got = pread(fd, out.data() + done, size - done, static_cast<off_t>(done));
    if (got < 0) {
      if (errno == EINTR) continue;
      throw Error(ErrorKind::kIo, display_path, "pread of " + ByteRangeText(done, size) + ": " + ErrnoText(errno));
    }
    if (got == 0) {
      throw Error(ErrorKind::kCheckpoint, display_path,
                  "ends at byte " + std::to_string(done) + " while reading " + ByteRangeText(0, size) +
                      ": the file was truncated or changed while open");
    }
    done += static_cast<uint64_t>(got);
  }
  return out;
}

}  // namespace shardcast
