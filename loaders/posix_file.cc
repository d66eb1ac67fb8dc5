#include "loaders/posix_file.h"

#include <fcntl.h>
#include <linux/openat2.h>
#include <sys/syscall.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <deque>
#include <map>
#include <mutex>
#include <vector>

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

namespace {

constexpr int kOpenFlags = O_RDONLY | O_NONBLOCK | O_CLOEXEC | O_NOCTTY;
constexpr int kMaxLinks = 40;  // the kernel's own limit on symlinks in one lookup

// The descriptor `fd` (opened with O_NONBLOCK) as an OpenNode: fstat, then blocking reads again.
OpenNode Adopt(int fd, const std::string& display_path) {
  OpenNode node;
  node.fd = UniqueFd(fd);
  if (fstat(fd, &node.st) != 0) throw Error(ErrorKind::kIo, display_path, "cannot stat: " + ErrnoText(errno));
  const int flags = fcntl(fd, F_GETFL);
  if (flags < 0 || fcntl(fd, F_SETFL, flags & ~O_NONBLOCK) != 0) {
    throw Error(ErrorKind::kIo, display_path, "cannot clear O_NONBLOCK: " + ErrnoText(errno));
  }
  return node;
}

// open() of a Unix socket fails with ENXIO; say what the name is rather than quoting errno.
[[noreturn]] void NotOpenable(const struct stat* st, const std::string& display_path, int err) {
  if (err == ELOOP) {  // a name the user gave (the root) whose symlinks loop: bad input, as a file's loop
    throw Error(ErrorKind::kCheckpoint, display_path, "symlink loop: the kernel stopped following its symlinks");
  }
  if (err == ENXIO && st != nullptr && !S_ISREG(st->st_mode)) {
    throw Error(ErrorKind::kCheckpoint, display_path,
                std::string("is ") + FileKindText(st->st_mode) + ", not a regular file");
  }
  throw Error(ErrorKind::kIo, display_path, "cannot open: " + ErrnoText(err));
}

[[noreturn]] void Escapes(const std::string& display_path, const std::string& root_path) {
  throw Error(ErrorKind::kCheckpoint, display_path,
              "resolves outside " + root_path + ": every name of a checkpoint, symlinks included, must stay beneath it");
}

[[noreturn]] void Loop(const std::string& display_path) {
  throw Error(ErrorKind::kCheckpoint, display_path,
              "symlink loop: more than " + std::to_string(kMaxLinks) + " symlinks followed");
}

int OpenatRetrying(int dirfd, const char* name, int flags) {
  int fd;
  do {
    fd = ::openat(dirfd, name, flags);
  } while (fd < 0 && errno == EINTR);
  return fd;
}

// openat2 beneath dirfd. EAGAIN is the kernel seeing a concurrent rename during a ".." step: retried.
int Openat2(int dirfd, const char* name, uint64_t flags) {
  struct open_how how {};
  how.flags = flags;
  how.resolve = RESOLVE_BENEATH | RESOLVE_NO_MAGICLINKS;
  long fd = -1;
  for (int tries = 0; tries < 1000; ++tries) {
    fd = syscall(SYS_openat2, dirfd, name, &how, sizeof(how));
    if (fd >= 0 || (errno != EINTR && errno != EAGAIN)) break;
  }
  return static_cast<int>(fd);
}

// nullopt: fall back to the walk (a kernel or sandbox without openat2).
std::optional<std::optional<OpenNode>> BeneathByOpenat2(int rootfd, const std::string& root_path, const std::string& name,
                                                        const std::string& display_path) {
  const int fd = Openat2(rootfd, name.c_str(), kOpenFlags);
  if (fd >= 0) return Adopt(fd, display_path);
  const int err = errno;
  switch (err) {
    case ENOENT:
    case ENOTDIR:
      return std::optional<OpenNode>();
    case EXDEV:
      Escapes(display_path, root_path);
    case ELOOP:
      Loop(display_path);
    case ENOSYS:
    case E2BIG:
    case EPERM:  // a seccomp filter that does not know the call
      return std::nullopt;
    case ENXIO: {
      // Only the message's words come from this second lookup; nothing is read through it.
      struct stat st;
      UniqueFd path_fd(Openat2(rootfd, name.c_str(), O_PATH | O_CLOEXEC));
      NotOpenable(path_fd.get() >= 0 && fstat(path_fd.get(), &st) == 0 ? &st : nullptr, display_path, err);
    }
    default:
      NotOpenable(nullptr, display_path, err);
  }
}

// readlinkat's target; nullopt when `name` is not a symlink (EINVAL) or is gone.
std::optional<std::string> ReadLinkAt(int dirfd, const std::string& name, const std::string& display_path) {
  std::string buf(4096, '\0');
  const ssize_t n = readlinkat(dirfd, name.c_str(), buf.data(), buf.size());
  if (n < 0) {
    if (errno == EINVAL || errno == ENOENT) return std::nullopt;
    throw Error(ErrorKind::kIo, display_path, "cannot read symlink '" + name + "': " + ErrnoText(errno));
  }
  if (static_cast<size_t>(n) == buf.size()) {
    throw Error(ErrorKind::kCheckpoint, display_path, "symlink '" + name + "' has a target of 4096 bytes or more");
  }
  buf.resize(static_cast<size_t>(n));
  return buf;
}

// Prepends the components of `path` to `pending`, in order.
void PushFront(std::deque<std::string>* pending, const std::string& path) {
  std::vector<std::string> parts;
  size_t begin = 0;
  while (begin <= path.size()) {
    size_t end = path.find('/', begin);
    if (end == std::string::npos) end = path.size();
    if (end > begin) parts.push_back(path.substr(begin, end - begin));
    begin = end + 1;
  }
  pending->insert(pending->begin(), parts.begin(), parts.end());
}

// The walk: see the picture in posix_file.h. Every openat has O_NOFOLLOW, so the kernel follows no
// symlink by itself; each one is read here and its components resolved from the directory holding
// it, with ".." popping the stack of directories opened so far (the root is never popped).
std::optional<OpenNode> BeneathByWalk(int rootfd, const std::string& root_path, const std::string& name,
                                      const std::string& display_path) {
  if (!name.empty() && name[0] == '/') Escapes(display_path, root_path);
  std::vector<UniqueFd> dirs;  // opened beneath the root; empty: at the root
  auto top = [&] { return dirs.empty() ? rootfd : dirs.back().get(); };
  std::deque<std::string> pending;
  PushFront(&pending, name);
  int links = 0;
  while (!pending.empty()) {
    const std::string part = std::move(pending.front());
    pending.pop_front();
    const bool last = pending.empty();
    if (part == "." || part == "..") {
      if (part == "..") {
        if (dirs.empty()) Escapes(display_path, root_path);
        dirs.pop_back();
      }
      if (last) break;  // the directory reached is what is opened
      continue;
    }
    const int fd = OpenatRetrying(top(), part.c_str(), last ? kOpenFlags | O_NOFOLLOW
                                                            : O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    if (fd >= 0) {
      if (last) return Adopt(fd, display_path);
      dirs.emplace_back(fd);
      continue;
    }
    const int err = errno;
    if (err == ENOENT) return std::nullopt;
    if (err == ELOOP || err == ENOTDIR) {  // a symlink (O_NOFOLLOW), or a component that is no directory
      std::optional<std::string> target = ReadLinkAt(top(), part, display_path);
      if (!target) return std::nullopt;
      if (++links > kMaxLinks) Loop(display_path);
      if (target->empty()) return std::nullopt;
      if ((*target)[0] == '/') Escapes(display_path, root_path);
      PushFront(&pending, *target);
      continue;
    }
    struct stat st;
    NotOpenable(err == ENXIO && fstatat(top(), part.c_str(), &st, AT_SYMLINK_NOFOLLOW) == 0 ? &st : nullptr,
                display_path, err);
  }
  const int fd = OpenatRetrying(top(), ".", kOpenFlags);
  if (fd < 0) NotOpenable(nullptr, display_path, errno);
  return Adopt(fd, display_path);
}

}  // namespace

std::optional<OpenNode> OpenNodeAt(int dirfd, const std::string& name, const std::string& display_path) {
  const int fd = OpenatRetrying(dirfd, name.c_str(), kOpenFlags);
  if (fd < 0) {
    const int err = errno;
    if (err == ENOENT || err == ENOTDIR) return std::nullopt;
    struct stat st;
    NotOpenable(err == ENXIO && fstatat(dirfd, name.c_str(), &st, 0) == 0 ? &st : nullptr, display_path, err);
  }
  return Adopt(fd, display_path);
}

bool KernelHasOpenat2() {
  static const bool has = [] {
    const int fd = Openat2(AT_FDCWD, ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0) return false;
    ::close(fd);
    return true;
  }();
  return has;
}

std::optional<OpenNode> OpenNodeBeneath(int rootfd, const std::string& root_path, const std::string& name,
                                        const std::string& display_path, BeneathResolver how) {
  if (how != BeneathResolver::kWalk && (how == BeneathResolver::kOpenat2 || KernelHasOpenat2())) {
    if (auto opened = BeneathByOpenat2(rootfd, root_path, name, display_path)) return std::move(*opened);
    if (how == BeneathResolver::kOpenat2) {
      throw Error(ErrorKind::kUnsupported, display_path, "openat2 is not available in this kernel");
    }
  }
  return BeneathByWalk(rootfd, root_path, name, display_path);
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

namespace {

// A sysfs value in KiB, or 0 where the file is missing or unreadable.
uint64_t SysfsKib(const std::string& path) {
  UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (fd.get() < 0) return 0;
  char buf[32] = {};
  const ssize_t n = ::read(fd.get(), buf, sizeof(buf) - 1);
  if (n <= 0) return 0;
  return std::strtoull(buf, nullptr, 10);
}

uint64_t ReadaheadStepUncached(dev_t st_dev) {
  const std::string id = std::to_string(major(st_dev)) + ":" + std::to_string(minor(st_dev));
  for (const std::string& queue : {"/sys/dev/block/" + id + "/queue/", "/sys/dev/block/" + id + "/../queue/"}) {
    const uint64_t kib = std::max(SysfsKib(queue + "read_ahead_kb"), SysfsKib(queue + "max_sectors_kb"));
    if (kib > 0) return kib << 10;
  }
  const uint64_t bdi = SysfsKib("/sys/class/bdi/" + id + "/read_ahead_kb");
  return bdi > 0 ? bdi << 10 : 128u << 10;
}

}  // namespace

uint64_t ReadaheadStepBytes(dev_t st_dev) {
  static std::mutex mu;
  static std::map<dev_t, uint64_t> cache;
  std::lock_guard<std::mutex> l(mu);
  auto it = cache.find(st_dev);
  if (it == cache.end()) {
    const uint64_t page = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
    it = cache.emplace(st_dev, std::max(page, ReadaheadStepUncached(st_dev))).first;
  }
  return it->second;
}

void AdviseWillNeed(int fd, dev_t st_dev, uint64_t offset, uint64_t n) {
  const uint64_t step = ReadaheadStepBytes(st_dev);
  for (uint64_t at = offset; at < offset + n; at += step) {
    posix_fadvise(fd, static_cast<off_t>(at), static_cast<off_t>(std::min(step, offset + n - at)), POSIX_FADV_WILLNEED);
  }
}

}  // namespace shardcast
