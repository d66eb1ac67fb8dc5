#include "bench/baseline_load.h"

#include <ATen/ATen.h>
#include <fcntl.h>
#include <unistd.h>

#include <chrono>
#include <cstring>

#include "allocators/error.h"
#include "allocators/lazy_zero.h"
#include "runtime/torch_dtype.h"

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
  r.seconds = seconds;
  r.ranks = GatherReports(comm, mine);
  return r;
}

PreadResult PreadCheckpoint(const std::string& checkpoint, bool fresh) {
  auto ckpt = Checkpoint::Open(checkpoint, OpenOptions{ReadMode::kPread});
  std::vector<unsigned char> reused(fresh ? 0 : 64u << 20);
  PreadResult r;
  const auto t0 = Clock::now();
  for (size_t i = 0; i < ckpt->num_files(); ++i) {
    const SafetensorsFile& f = ckpt->file(i);
    int fd = ::open(f.path().c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) throw Error(ErrorKind::kIo, f.path(), "cannot open: " + ErrnoText(errno));
    const uint64_t data = f.file_size() - f.header().data_offset();
    auto* dst = fresh ? static_cast<unsigned char*>(LazyZeroAllocate(std::max<uint64_t>(data, 1))) : nullptr;
    for (uint64_t off = f.header().data_offset(); off < f.file_size();) {
      const uint64_t want = std::min<uint64_t>(64u << 20, f.file_size() - off);
      unsigned char* to = fresh ? dst + (off - f.header().data_offset()) : reused.data();
      ssize_t n = pread(fd, to, want, static_cast<off_t>(off));
      if (n <= 0) break;
      off += static_cast<uint64_t>(n);
      r.bytes += static_cast<uint64_t>(n);
    }
    if (fresh) LazyZeroFree(dst, std::max<uint64_t>(data, 1));
    ::close(fd);
  }
  r.seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  return r;
}

}  // namespace shardcast::bench
