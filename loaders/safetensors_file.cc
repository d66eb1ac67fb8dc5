#include "loaders/safetensors_file.h"

#include <fcntl.h>
#include <setjmp.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <mutex>
#include <new>
#include <optional>
#include <vector>

#include "allocators/error.h"
#include "loaders/posix_file.h"

namespace shardcast {
namespace {

[[noreturn]] void FailIo(const std::string& path, const std::string& what, int err) {
  throw Error(ErrorKind::kIo, path, what + ": " + ErrnoText(err));
}

// ---- SIGBUS guard ---------------------------------------------------------------------------
// A mapping whose file shrinks raises SIGBUS on the vanished pages. The guard turns that into a
// return value for copies that opted in; any other SIGBUS goes to the previous handler.
struct Guard {
  sigjmp_buf env;
  const char* begin = nullptr;
  const char* end = nullptr;
};
thread_local Guard* t_guard = nullptr;
struct sigaction g_previous_bus;
std::once_flag g_install_once;

void OnSigbus(int sig, siginfo_t* info, void* ctx) {
  Guard* g = t_guard;
  const char* addr = static_cast<const char*>(info->si_addr);
  if (g != nullptr && addr >= g->begin && addr < g->end) siglongjmp(g->env, 1);
  // Not ours: behave as if we were never installed.
  if (g_previous_bus.sa_flags & SA_SIGINFO) {
    g_previous_bus.sa_sigaction(sig, info, ctx);
  } else if (g_previous_bus.sa_handler == SIG_DFL || g_previous_bus.sa_handler == SIG_IGN) {
    signal(SIGBUS, SIG_DFL);  // returning re-executes the faulting access, which now kills us
  } else {
    g_previous_bus.sa_handler(sig);
  }
}

void InstallSigbusHandler() {
  std::call_once(g_install_once, [] {
    struct sigaction sa;
    std::memset(&sa, 0, sizeof(sa));
    sa.sa_sigaction = OnSigbus;
    sa.sa_flags = SA_SIGINFO | SA_NODEFER;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGBUS, &sa, &g_previous_bus);
  });
}

constexpr uint64_t kMaxFaultMapBytes = 2 << 20;  // the largest a single fault maps: a PMD-sized folio

// "bytes [offset, offset + n)", spelled out when offset + n does not fit in 64 bits.
std::string SpanText(uint64_t offset, uint64_t n) {
  uint64_t end;
  if (!__builtin_add_overflow(offset, n, &end)) return ByteRangeText(offset, end);
  return "bytes [" + std::to_string(offset) + ", " + std::to_string(offset) + " + " + std::to_string(n) + ")";
}

// XXH3-64 of the length prefix and the header JSON, as they are in the file.
uint64_t HeaderDigest(const unsigned char (&prefix)[8], std::string_view json) {
  XXH3_state_t* state = XXH3_createState();
  if (state == nullptr) throw std::bad_alloc();
  XXH3_64bits_reset(state);
  XXH3_64bits_update(state, prefix, sizeof(prefix));
  XXH3_64bits_update(state, json.data(), json.size());
  const uint64_t digest = XXH3_64bits_digest(state);
  XXH3_freeState(state);
  return digest;
}

uint64_t PageSize() {
  static const uint64_t page = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
  return page;
}

}  // namespace

bool GuardedCopy(void* dst, const void* src, size_t n) {
  InstallSigbusHandler();
  Guard g;
  g.begin = static_cast<const char*>(src);
  g.end = g.begin + n;
  Guard* saved = t_guard;
  if (sigsetjmp(g.env, 1) != 0) {
    t_guard = saved;
    return false;
  }
  // The fences keep the compiler from dropping or moving the stores around memcpy: only the signal
  // handler reads t_guard, and nothing the compiler can see does.
  t_guard = &g;
  std::atomic_signal_fence(std::memory_order_seq_cst);
  std::memcpy(dst, src, n);
  std::atomic_signal_fence(std::memory_order_seq_cst);
  t_guard = saved;
  return true;
}

std::unique_ptr<SafetensorsFile> SafetensorsFile::Open(const std::string& path, const OpenOptions& options) {
  return OpenAt(AT_FDCWD, path, path, options);
}

std::unique_ptr<SafetensorsFile> SafetensorsFile::OpenAt(int dirfd, const std::string& name,
                                                         const std::string& display_path,
                                                         const OpenOptions& options) {
  std::optional<OpenNode> node = OpenNodeAt(dirfd, name, display_path);
  if (!node) throw Error(ErrorKind::kIo, display_path, "cannot open: " + ErrnoText(ENOENT));
  return FromDescriptor(node->fd.release(), display_path, options);
}

std::unique_ptr<SafetensorsFile> SafetensorsFile::FromDescriptor(int fd, const std::string& display_path,
                                                                 const OpenOptions& options) {
  UniqueFd owned(fd);
  std::unique_ptr<SafetensorsFile> f(new SafetensorsFile());
  f->fd_ = owned.release();  // closed by ~SafetensorsFile if anything below throws
  f->path_ = display_path;
  f->mode_ = options.mode;
  struct stat st;
  if (fstat(fd, &st) != 0) FailIo(display_path, "cannot stat", errno);
  RequireRegularFile(st.st_mode, display_path);
  f->file_size_ = static_cast<uint64_t>(st.st_size);
  f->dev_ = st.st_dev;

  unsigned char prefix[8] = {0};
  if (f->file_size_ >= 8) f->ReadBytes(0, 8, prefix, "header length");
  uint64_t n = ParseHeaderLength(display_path, prefix, f->file_size_);
  std::string json(n, '\0');
  f->ReadBytes(8, n, json.data(), "header");
  f->header_digest_ = HeaderDigest(prefix, json);
  f->data_offset_ = 8 + n;
  if (options.known_header_digest == 0 || f->header_digest_ != options.known_header_digest) {
    f->header_ = ParseHeader(display_path, json, f->file_size_);
  }

  if (options.mode == ReadMode::kMmap && f->file_size_ > 0) {
    void* p = mmap(nullptr, f->file_size_, PROT_READ, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) FailIo(display_path, "cannot mmap " + std::to_string(f->file_size_) + " bytes", errno);
    f->map_ = static_cast<const unsigned char*>(p);
    if (options.sequential_hint) madvise(p, f->file_size_, MADV_SEQUENTIAL);
  }
  if (options.sequential_hint) posix_fadvise(fd, 0, 0, POSIX_FADV_SEQUENTIAL);
  return f;
}

uint64_t SafetensorsFile::SampleDigest() const {
  const uint64_t begin = std::min(data_offset_, file_size_);
  const uint64_t bytes = file_size_ - begin;
  std::vector<unsigned char> sample;
  auto take = [&](uint64_t offset, uint64_t n) {
    const size_t at = sample.size();
    sample.resize(at + n);
    ReadBytes(offset, n, sample.data() + at, "data sample");
  };
  if (bytes <= 3 * kSampleBytes) {
    take(begin, bytes);
  } else {
    take(begin, kSampleBytes);
    take(begin + (bytes - kSampleBytes) / 2, kSampleBytes);
    take(file_size_ - kSampleBytes, kSampleBytes);
  }
  return XXH3_64bits(sample.data(), sample.size());
}

SafetensorsFile::~SafetensorsFile() {
  if (map_ != nullptr) munmap(const_cast<unsigned char*>(map_), file_size_);
  if (fd_ >= 0) ::close(fd_);
}

const TensorInfo& SafetensorsFile::Get(std::string_view key) const {
  const TensorInfo* t = Find(key);
  if (t == nullptr) {
    throw Error(ErrorKind::kCheckpoint, path_, "no tensor '" + std::string(key) + "' in this file");
  }
  return *t;
}

void SafetensorsFile::CheckRows(const TensorInfo& t, uint64_t r0, uint64_t r1) const {
  if (r0 > r1 || r1 > t.rows()) {
    throw Error(ErrorKind::kInvalidArgument, path_,
                "tensor '" + t.key + "': rows [" + std::to_string(r0) + ", " + std::to_string(r1) +
                    ") out of range for " + std::to_string(t.rows()) + " rows");
  }
}

uint64_t SafetensorsFile::RowOffset(const TensorInfo& t, uint64_t r0) const {
  CheckRows(t, r0, r0);
  return header_.data_offset() + t.begin + r0 * t.row_bytes();
}

uint64_t SafetensorsFile::RowRangeBytes(const TensorInfo& t, uint64_t r0, uint64_t r1) const {
  CheckRows(t, r0, r1);
  return (r1 - r0) * t.row_bytes();
}

ByteSpan SafetensorsFile::View(const TensorInfo& t) const { return RowRange(t, 0, t.rows()); }

ByteSpan SafetensorsFile::RowRange(const TensorInfo& t, uint64_t r0, uint64_t r1) const {
  if (mode_ != ReadMode::kMmap) {
    throw Error(ErrorKind::kInvalidArgument, path_, "zero-copy views need ReadMode::kMmap; use ReadRows");
  }
  uint64_t n = RowRangeBytes(t, r0, r1);
  return ByteSpan{map_ == nullptr ? nullptr : map_ + RowOffset(t, r0), n};
}

void SafetensorsFile::ReadRows(const TensorInfo& t, uint64_t r0, uint64_t r1, void* dst) const {
  uint64_t n = RowRangeBytes(t, r0, r1);
  ReadBytes(RowOffset(t, r0), n, dst,
            "tensor '" + t.key + "' rows [" + std::to_string(r0) + ", " + std::to_string(r1) + ")");
}

void SafetensorsFile::CheckInFile(uint64_t offset, uint64_t n, std::string_view what) const {
  // Overflow-safe offset + n <= file_size_.
  if (offset > file_size_ || n > file_size_ - offset) {
    throw Error(ErrorKind::kCheckpoint, path_,
                std::string(what) + " at file " + SpanText(offset, n) + " is outside the file of " +
                    std::to_string(file_size_) + " bytes");
  }
}

void SafetensorsFile::ReadBytes(uint64_t offset, uint64_t n, void* dst, std::string_view what) const {
  CheckInFile(offset, n, what);
  if (n == 0) return;
  auto truncated = [&](uint64_t now_size) {
    return Error(ErrorKind::kCheckpoint, path_,
                 std::string(what) + " at file " + ByteRangeText(offset, offset + n) +
                     ": the file was truncated or changed while open (it was " +
                     std::to_string(file_size_) + " bytes, now " + std::to_string(now_size) + ")");
  };
  if (map_ != nullptr) {
    if (!GuardedCopy(dst, map_ + offset, n)) {
      struct stat st;
      throw truncated(fstat(fd_, &st) == 0 ? static_cast<uint64_t>(st.st_size) : 0);
    }
    return;
  }
  auto* out = static_cast<unsigned char*>(dst);
  uint64_t done = 0;
  while (done < n) {
    ssize_t got = pread(fd_, out + done, n - done, static_cast<off_t>(offset + done));
    if (got < 0) {
      if (errno == EINTR) continue;
      FailIo(path_, "pread of " + std::string(what) + " at " + ByteRangeText(offset, offset + n), errno);
    }
    if (got == 0) {
      struct stat st;
      throw truncated(fstat(fd_, &st) == 0 ? static_cast<uint64_t>(st.st_size) : 0);
    }
    done += static_cast<uint64_t>(got);
  }
}

void SafetensorsFile::Prefetch(uint64_t offset, uint64_t n) const {
  if (n == 0 || offset >= file_size_) return;
  n = std::min(n, file_size_ - offset);
  // fadvise works on the page cache whether or not the file is mapped, and returns once the reads are
  // queued; MADV_WILLNEED on the mapping would do the same through the VMA. One call reads at most the
  // device's read-ahead limit, so a larger range is asked for in steps (AdviseWillNeed).
  AdviseWillNeed(fd_, dev_, offset, n);
}

void SafetensorsFile::ReleasePages(uint64_t offset, uint64_t n, Release how) const {
  CheckInFile(offset, n, "release of pages");
  if (n == 0) return;
  // Rounded outward to 2 MiB windows, not just to pages: one fault maps a whole fault-around window,
  // and with large page-cache folios (ext4 on Linux 6.x) a whole folio, up to PMD size. Measured here:
  // one touch mapped ~1 MiB, and page rounding left RssFile growing with the checkpoint (1.7 GB on an
  // 8.7 GB load). Rounding outward never loses data; a released page not yet consumed is mapped
  // again from the page cache when read.
  const uint64_t window = std::max<uint64_t>(PageSize(), kMaxFaultMapBytes);
  uint64_t begin = offset / window * window;
  uint64_t end = std::min(file_size_, (offset + n + window - 1) / window * window);
  if (map_ != nullptr && end > begin) {
    madvise(const_cast<unsigned char*>(map_) + begin, end - begin, MADV_DONTNEED);
  }
  if (how == Release::kMappingAndCache) {
    posix_fadvise(fd_, static_cast<off_t>(begin), static_cast<off_t>(end - begin), POSIX_FADV_DONTNEED);
  }
}

}  // namespace shardcast
