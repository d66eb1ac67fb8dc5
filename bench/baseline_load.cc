#include "bench/baseline_load.h"

#include <ATen/ATen.h>
#include <fcntl.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <vector>

#include "allocators/error.h"
#include "allocators/lazy_zero.h"
#include "loaders/checkpoint.h"
#include "runtime/materialize/torch_dtype.h"

namespace shardcast::bench {

using Clock = std::chrono::steady_clock;

LoadReport BaselineLoad(Communicator& comm, RankState* state, const std::string& checkpoint) {
  const auto t0 = Clock::now();
  const MemorySnapshot base = ReadMemory();
  PeakSampler sampler;
  const Plan& plan = state->plan();
  const int me = comm.rank(), world = comm.world_size();
  std::unique_ptr<Checkpoint> ckpt;
  if (me == 0) ckpt = Checkpoint::Open(checkpoint);
  // The full state dict on rank 0; zeros-like full copies everywhere else.
  std::vector<at::Tensor> full;
  std::vector<const PlanEntry*> entries;
  uint64_t total = 0;
  for (const PlanEntry& e : plan.entries()) {
    if (e.role == Role::kNonPersistentBuffer) continue;
    std::vector<int64_t> sizes(e.shape.begin(), e.shape.end());
    at::ScalarType dtype = ToScalarType(e.dtype);
    if (me == 0) {
      at::Tensor t = at::empty(sizes, dtype);
      const auto& ce = ckpt->Get(e.key);
      if (ce.info->dtype != e.dtype) throw Error(ErrorKind::kUnsupported, e.key, "the baseline does not convert dtypes");
      ce.file->ReadRows(*ce.info, 0, ce.info->rows(), t.data_ptr());
      full.push_back(t);
    } else {
      full.push_back(at::zeros(sizes, dtype));
    }
    entries.push_back(&e);
    total += e.nbytes();
  }
  state->AllocateShards();
  uint64_t received = 0, stored = 0;
  for (size_t i = 0; i < entries.size(); ++i) {
    const PlanEntry& e = *entries[i];
    comm.Broadcast(full[i].data_ptr(), e.nbytes(), 0);  // the whole tensor to every rank
    if (me != 0) received += e.nbytes();
    LocalTensor* local = state->Find(e.key);
    // The baseline broadcasts FSDP2's dim-0 layout only: this rank's rows are one span of dim 0.
    const Piece piece = e.PieceOf(me);
    const uint64_t n = piece.numel() * DTypeSize(e.dtype);
    const uint64_t row_bytes = e.shape.empty() || e.shape[0] == 0 ? 0 : e.nbytes() / e.shape[0];
    const uint64_t begin = piece.dims.empty() || piece.dims[0].empty() ? 0 : piece.dims[0][0].begin;
    std::memcpy(local->tensor.data_ptr(), static_cast<const char*>(full[i].data_ptr()) + begin * row_bytes, n);
    stored += n;
  }
  comm.Barrier();
  const double seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  MemoryPeaks peaks = sampler.Stop();
  auto above = [](uint64_t v, uint64_t b) { return v > b ? v - b : 0; };
  RankReport mine;
  mine.bytes_received = received, mine.bytes_stored = stored;
  mine.bytes_sent = me == 0 ? total * (world - 1) : 0, mine.bytes_read = me == 0 ? total : 0;
  mine.seconds = seconds;
  mine.peak_rss_anon = above(peaks.rss_anon, base.rss_anon), mine.peak_rss_file = above(peaks.rss_file, base.rss_file);
  mine.baseline_rss_anon = base.rss_anon, mine.baseline_rss_file = base.rss_file;
  LoadReport r;
  r.source = "baseline-broadcast";
  r.target = "cpu";
  r.backend = comm.backend();
  r.world_size = world;
  r.entries = entries.size();
  r.total_bytes = total;
  r.checkpoint_bytes = total;  // read once, by rank 0: the report's storage reads are then 1.00x
  r.mesh = "mesh (" + std::to_string(world) + ")";  // FSDP dim-0 rows only, as above
  r.nodes = 1;
  r.seconds = seconds;
  r.ranks = GatherReports(comm, mine);
  return r;
}

namespace {

// One run of a file's data bytes: [offset, offset + bytes).
struct DataSpan {
  std::string path;
  uint64_t offset = 0, bytes = 0;
};

// pread `spans` (or the part of them that [begin, end) of their concatenation covers) into `dst`, or
// into one reused buffer when dst is null. Returns the bytes read.
uint64_t PreadSpans(const std::vector<DataSpan>& spans, uint64_t begin, uint64_t end, unsigned char* dst,
                    std::vector<unsigned char>* reused) {
  uint64_t at = 0, read = 0;
  for (const DataSpan& s : spans) {
    const uint64_t lo = std::max(begin, at), hi = std::min(end, at + s.bytes);
    at += s.bytes;
    if (lo >= hi) continue;
    int fd = ::open(s.path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) throw Error(ErrorKind::kIo, s.path, "cannot open: " + ErrnoText(errno));
    for (uint64_t off = lo; off < hi;) {  // `off` in the concatenation; the file offset is off - (at - s.bytes)
      const uint64_t want = std::min<uint64_t>(64u << 20, hi - off);
      unsigned char* to = dst != nullptr ? dst + (off - begin) : reused->data();
      ssize_t n = pread(fd, to, want, static_cast<off_t>(s.offset + off - (at - s.bytes)));
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) {
        const int err = n < 0 ? errno : 0;
        ::close(fd);
        throw Error(ErrorKind::kIo, s.path, "pread failed: " + (n < 0 ? ErrnoText(err) : std::string("short file")));
      }
      off += static_cast<uint64_t>(n);
      read += static_cast<uint64_t>(n);
    }
    ::close(fd);
  }
  return read;
}

double Seconds(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

double CpuSeconds(int who) {
  struct rusage u {};
  getrusage(who, &u);
  return u.ru_utime.tv_sec + u.ru_stime.tv_sec + (u.ru_utime.tv_usec + u.ru_stime.tv_usec) / 1e6;
}

}  // namespace

PreadResult PreadCheckpoint(const std::string& checkpoint, bool fresh, int nproc) {
  if (nproc < 1) throw Error(ErrorKind::kInvalidArgument, checkpoint, "bench-pread: --nproc must be at least 1");
  std::vector<DataSpan> spans;
  uint64_t total = 0;
  {
    auto ckpt = Checkpoint::Open(checkpoint, OpenOptions{ReadMode::kPread});
    for (size_t i = 0; i < ckpt->num_files(); ++i) {
      const SafetensorsFile& f = ckpt->file(i);
      spans.push_back({f.path(), f.header().data_offset(), f.file_size() - f.header().data_offset()});
      total += spans.back().bytes;
    }
  }
  PreadResult r;
  if (nproc == 1) {
    // One process: file by file, each file's destination freed after it (a fresh mapping each time).
    std::vector<unsigned char> reused(fresh ? 0 : 64u << 20);
    const auto t0 = Clock::now();
    const double cpu0 = CpuSeconds(RUSAGE_SELF);
    uint64_t at = 0;
    for (const DataSpan& s : spans) {
      unsigned char* dst = fresh ? static_cast<unsigned char*>(LazyZeroAllocate(std::max<uint64_t>(s.bytes, 1))) : nullptr;
      r.bytes += PreadSpans(spans, at, at + s.bytes, dst, &reused);
      if (fresh) LazyZeroFree(dst, std::max<uint64_t>(s.bytes, 1));
      at += s.bytes;
    }
    r.seconds = Seconds(t0);
    r.cpu_seconds = CpuSeconds(RUSAGE_SELF) - cpu0;
    return r;
  }
  // nproc processes, each reading its contiguous 1/nproc of the data bytes, started together (a pipe
  // each child blocks on), each holding what it read until it ends: as each-rank's ranks land their shards.
  int go[2], done[2];
  if (pipe2(go, O_CLOEXEC) != 0 || pipe2(done, O_CLOEXEC) != 0) throw Error(ErrorKind::kIo, "bench-pread", "pipe: " + ErrnoText(errno));
  std::vector<pid_t> kids;
  for (int p = 0; p < nproc; ++p) {
    const pid_t pid = fork();
    if (pid < 0) throw Error(ErrorKind::kIo, "bench-pread", "fork: " + ErrnoText(errno));
    if (pid == 0) {
      ::close(go[1]);
      ::close(done[0]);
      char c;
      while (::read(go[0], &c, 1) < 0 && errno == EINTR) {
      }
      const uint64_t begin = total * p / nproc, end = total * (p + 1) / nproc;
      uint64_t got = 0;
      try {
        std::vector<unsigned char> reused(fresh ? 0 : 64u << 20);
        auto* dst = fresh ? static_cast<unsigned char*>(LazyZeroAllocate(std::max<uint64_t>(end - begin, 1))) : nullptr;
        got = PreadSpans(spans, begin, end, dst, &reused);
      } catch (const std::exception& e) {
        std::fprintf(stderr, "bench-pread: process %d: %s\n", p, e.what());
        _exit(1);
      }
      if (::write(done[1], &got, sizeof(got)) != static_cast<ssize_t>(sizeof(got))) _exit(1);
      _exit(0);  // its memory is released only now, after every byte of its part was landed
    }
    kids.push_back(pid);
  }
  ::close(go[0]);
  ::close(done[1]);
  const auto t0 = Clock::now();
  ::close(go[1]);  // every child's read returns 0: go
  bool ok = true;
  for (int p = 0; p < nproc; ++p) {
    uint64_t got = 0;
    if (::read(done[0], &got, sizeof(got)) != static_cast<ssize_t>(sizeof(got))) {
      ok = false;
      break;
    }
    r.bytes += got;
  }
  r.seconds = Seconds(t0);
  ::close(done[0]);
  for (pid_t pid : kids) {
    int status = 0;
    while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {
    }
    ok = ok && WIFEXITED(status) && WEXITSTATUS(status) == 0;
  }
  if (!ok) throw Error(ErrorKind::kIo, checkpoint, "bench-pread: a reading process failed (see above)");
  r.cpu_seconds = CpuSeconds(RUSAGE_CHILDREN);  // this process had no children before
  return r;
}

}  // namespace shardcast::bench
