// loaders/posix_file: opening checkpoint files without trusting them. Internal to loaders/.
//
// Every file of a checkpoint is opened exactly once, by OpenNodeBeneath (or OpenNodeAt for a path the
// user named), and from then on is known only
// by its descriptor: what it is and how big it is come from fstat on that descriptor, never from a
// second lookup of its name (which a concurrent rename or symlink swap could redirect).
//
//   open(name, O_RDONLY | O_NONBLOCK | O_CLOEXEC | O_NOCTTY)   a FIFO does not block, a tty is not taken
//   fstat(fd)                                                   regular file? its size
//   fcntl(fd, F_SETFL, flags & ~O_NONBLOCK)                     ordinary blocking reads from here on
//
// Thread safety: free functions, safe from any thread. Failure: shardcast::Error, kCheckpoint for a
// file that is not what a checkpoint needs (naming the path and what it is), kIo when the OS refuses.
#pragma once

#include <sys/stat.h>

#include <cstdint>
#include <optional>
#include <string>

namespace shardcast {

// Owns a file descriptor; closes it on destruction. Move-only.
class UniqueFd {
 public:
  UniqueFd() = default;
  explicit UniqueFd(int fd) : fd_(fd) {}
  UniqueFd(UniqueFd&& o) noexcept : fd_(o.release()) {}
  UniqueFd& operator=(UniqueFd&& o) noexcept;
  UniqueFd(const UniqueFd&) = delete;
  UniqueFd& operator=(const UniqueFd&) = delete;
  ~UniqueFd() { reset(); }

  int get() const { return fd_; }
  int release() {
    int fd = fd_;
    fd_ = -1;
    return fd;
  }
  void reset();

 private:
  int fd_ = -1;
};

// An open file and what fstat said about it at open.
struct OpenNode {
  UniqueFd fd;
  struct stat st {};
};

// "a FIFO", "a socket", "a character device", "a block device", "a directory", "a symbolic link",
// "a regular file", or "an unknown kind of file".
const char* FileKindText(mode_t mode);

// Opens `name` relative to the directory `dirfd` (AT_FDCWD: the working directory; an absolute name
// ignores dirfd), following symlinks, without blocking on FIFOs, and fstats it. O_NONBLOCK is
// cleared again before it returns. Returns nullopt when the name does not exist (ENOENT, or a path
// component that is not a directory). A socket (which open refuses with ENXIO) is a kCheckpoint
// error naming `display_path`; other refusals are kIo.
std::optional<OpenNode> OpenNodeAt(int dirfd, const std::string& name, const std::string& display_path);

// How OpenNodeBeneath resolves a name. kAuto: openat2 where the kernel has it, else the walk.
enum class BeneathResolver {
  kAuto,     // default
  kOpenat2,  // openat2(RESOLVE_BENEATH | RESOLVE_NO_MAGICLINKS): the kernel refuses any escape (Linux >= 5.6)
  kWalk,     // one component at a time: openat(O_NOFOLLOW), every symlink read and resolved here
};

// Whether this kernel has openat2 (checked once).
bool KernelHasOpenat2();

// Opens `name` (relative; "/"-separated; "." and ".." and symlinks allowed) beneath the directory
// `rootfd`, without blocking on FIFOs, and fstats it, like OpenNodeAt. Every symlink on the way is
// followed only as far as it stays beneath the root: an absolute target, or ".." out of the root, is
// kCheckpoint "<display_path>: resolves outside <root_path>". More than 40 links in one lookup is
// kCheckpoint "symlink loop". Race-free: no name is looked up twice, so a symlink swapped meanwhile
// can change which file inside the root is opened, never let one outside be. Returns nullopt when the
// name does not exist. Thread safety: safe from any thread.
//
//   kWalk, for "sub/link/x" with sub/link -> ../other:
//     stack [root]           openat(root, "sub", O_DIRECTORY | O_NOFOLLOW)      push
//     stack [root, sub]      openat(sub, "link", ...) fails ELOOP/ENOTDIR        readlinkat: "../other"
//     pending "../other/x"   ".." pops (popping the root itself is an escape)    stack [root]
//     stack [root, other]    openat(other, "x", O_NOFOLLOW): the file
std::optional<OpenNode> OpenNodeBeneath(int rootfd, const std::string& root_path, const std::string& name,
                                        const std::string& display_path,
                                        BeneathResolver how = BeneathResolver::kAuto);

// Throws kCheckpoint "<display_path>: is a FIFO, not a regular file" unless `mode` (from fstat) is
// a regular file's.
void RequireRegularFile(mode_t mode, const std::string& display_path);

// The most bytes one posix_fadvise(POSIX_FADV_WILLNEED) call makes the kernel read for this file:
// the kernel clamps each call to max(read_ahead_kb, max_sectors_kb) of the file's device (measured:
// one 64 MiB call on a disk with read_ahead_kb 8192 brought in 8 MiB), so read-ahead of a larger
// range is issued in steps of this. From sysfs for the device of `st_dev` (the whole disk's queue for
// a partition, the bdi's read_ahead_kb for a network or virtual filesystem); 128 KiB, the kernel's
// default read-ahead, where sysfs says nothing. Cached per device; thread-safe.
uint64_t ReadaheadStepBytes(dev_t st_dev);

// Asks the kernel to read file bytes [offset, offset + n) of `fd` (on device `st_dev`) into the page
// cache: posix_fadvise(WILLNEED) in steps of ReadaheadStepBytes. Returns once the reads are queued;
// best effort, never throws.
void AdviseWillNeed(int fd, dev_t st_dev, uint64_t offset, uint64_t n);

// Reads exactly [0, size) of a regular file through its descriptor. REQUIRES: size is what fstat
// said. A file that ends early (it changed while open) is kCheckpoint naming the path and range.
std::string ReadWholeFile(int fd, uint64_t size, const std::string& display_path);

}  // namespace shardcast
