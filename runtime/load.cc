#include "runtime/load.h"

#include <sched.h>
#include <sys/resource.h>
#include <unistd.h>

#include <chrono>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <system_error>
#include <thread>
#include <vector>

#include <c10/core/DeviceGuard.h>

#include "allocators/commit_beside.h"
#include "allocators/error.h"
#include "allocators/tensor_alloc.h"
#include "runtime/agree/failure.h"
#include "runtime/agree/fault.h"
#include "runtime/agree/verdict.h"
#include "runtime/cpu_quota.h"
#include "runtime/engine/stream.h"
#include "runtime/engine/verify.h"
#include "runtime/handshake.h"
#include "runtime/report_fields.h"

namespace shardcast {
namespace {

using Clock = std::chrono::steady_clock;

double Since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

// User + system CPU seconds of the whole process so far.
double CpuSeconds() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  auto s = [](const timeval& t) { return static_cast<double>(t.tv_sec) + t.tv_usec / 1e6; };
  return s(u.ru_utime) + s(u.ru_stime);
}

// The threads this rank fills its memory and reads with (read_threads' default, ReadThreadsFor): where the
// process is bound to fewer CPUs than the machine has (a launcher's per-rank binding), those CPUs are its
// own; otherwise the machine's, within a cgroup quota (cpu_quota.h, its whole CPUs), are shared by the node's
// `sharers` ranks.
int ThreadsHere(const LoadOptions& options, int sharers) {
  const int machine = std::max(1u, std::thread::hardware_concurrency());
  int mine = machine;
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) == 0) mine = std::max(1, CPU_COUNT(&set));
  const int quota = WholeCpus(CpuQuotaOf(), INT_MAX);
  if (mine < machine) return ReadThreadsFor(options, 1, std::min(mine, quota));
  return ReadThreadsFor(options, sharers, std::min(machine, quota));
}

// This rank's host shards as pieces of at most 2 MiB cut at page boundaries, in the shards' order, for
// CommitBeside's threads to take one at a time (tensors under 1 MiB are left to the readers; those on meta
// or off the host have no pages to commit). With `keep` (threads that may outlive the load, where their
// priority cannot be lifted: commit_beside.h), only shards on lazy-zero mappings (this load's, or Python's
// `lazy_zero_tensor`), whose owners go in `keep`: they keep the pages mapped however the tensors are freed
// or swapped, with no c10 storage (whose last reference may call into Python from a thread of no
// interpreter) involved; other tensors of the caller's are left to the readers.
std::vector<std::pair<unsigned char*, size_t>> CommitPieces(RankState& state,
                                                            std::vector<std::shared_ptr<const void>>* keep) {
  constexpr size_t kMinBytes = 1 << 20, kPiece = 2 << 20;
  const uintptr_t page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  std::vector<std::pair<unsigned char*, size_t>> pieces;
  for (LocalTensor& t : state.tensors()) {
    if (t.is_meta() || !t.tensor.device().is_cpu() || t.tensor.nbytes() < kMinBytes) continue;
    if (keep != nullptr) {
      std::shared_ptr<const void> owner = t.mapping ? t.mapping : LazyZeroOwner(t.tensor.data_ptr(), t.tensor.nbytes());
      if (owner == nullptr) continue;
      keep->push_back(std::move(owner));
    }
    auto* p = static_cast<unsigned char*>(t.tensor.data_ptr());
    unsigned char* const end = p + t.tensor.nbytes();
    while (p < end) {
      const uintptr_t cut = std::max((reinterpret_cast<uintptr_t>(p) + kPiece) / page * page,
                                     reinterpret_cast<uintptr_t>(p) + 1);
      unsigned char* q = std::min(end, reinterpret_cast<unsigned char*>(cut));
      pieces.emplace_back(p, static_cast<size_t>(q - p));
      p = q;
    }
  }
  return pieces;
}

// Shard storage for this rank's rows, or the same error on every rank. The pages are committed beside
// the stream (`commit`), not before it. Measured at 1.91 GB, W=4, on the 2-core VM (medians of 3
// interleaved): cold 1.31 s against 1.60 s with the commit first (the disk reads while the pages are
// committed), warm 0.80 s against 0.78 s. The commit starts once the allocation is agreed, not before the
// agreement: its threads (the rank's share of the cores) no longer compete with the agreement's collective,
// and no rank commits for a load that another rank's failure ends. On the 2-core VM, W=4, 1.91 GB, medians of
// interleaved rounds: cold 1.165 s against 1.481 s (5 rounds) and 1.373 against 1.451 s (7 rounds), warm
// 0.682 against 0.654 s and 0.729 against 0.694 s (5 rounds each; within the VM's spread). On an H200 host's
// 16 cores (4 ranks) this step took 0.037-0.052 s with the commit started before the agreement.
void Allocate(Communicator& comm, RankState* state, bool checksum_only, int threads, CommitBeside* commit) {
  Problem local;
  try {
    FaultPoint("allocate", comm.rank());
    if (!checksum_only) {
      state->AllocateShards();
      // Threads that cannot be lifted are let go at the end: they get only what they can keep mapped.
      auto keep = MayLeaveIdlePriority() ? nullptr : std::make_shared<std::vector<std::shared_ptr<const void>>>();
      auto pieces = CommitPieces(*state, keep.get());
      commit->Prepare(std::move(pieces), threads, std::move(keep));
    }
  } catch (const std::exception& e) {
    local = AsProblem(e);
    local.message = "cannot allocate this rank's shards: " + local.message;  // the verdict names the rank
  }
  Together(comm, [&] {
    Agree(comm, "allocate", local);
    return 0;
  });
  commit->Start();
}

std::vector<at::Tensor> Targets(const Manifest& m, RankState* state) {
  std::vector<at::Tensor> out(m.entries.size());
  size_t cursor = 0;
  for (size_t i = 0; i < m.entries.size(); ++i) {
    LocalTensor* t = state->FindNext(m.entries[i].key, &cursor);
    if (t == nullptr) throw Error(ErrorKind::kInternal, std::string(m.entries[i].key), "agreed but not prepared");
    out[i] = t->tensor;
  }
  return out;
}

// The ranks on `me`'s node that read from storage: they share the node's read-ahead budget.
// The ranks of `world` on `me`'s node for which `counts(rank)` holds.
template <typename Counts>
int OnNode(const NodeMap& nodes, int world, int me, Counts&& counts) {
  const auto node = [&](int r) { return r < static_cast<int>(nodes.node_of_rank.size()) ? nodes.node_of_rank[r] : 0; };
  int n = 0;
  for (int r = 0; r < world; ++r) n += node(r) == node(me) && counts(r);
  return n;
}

int ReadersOnNode(const Route& route, const NodeMap& nodes, int me, bool verify) {
  return OnNode(nodes, route.world_size(), me, [&](int r) { return route.Reads(r, verify); });
}


}  // namespace

void FailLoad(Communicator& comm, ErrorKind kind, const std::string& problem) {
  FailHandshake(comm, kind, problem);
}

LoadReport Load(Communicator& comm, RankState* state, const LoadRequest& rq) {
  if (state->rank() != comm.rank()) {
    FailHandshake(comm, ErrorKind::kInvalidArgument,
                  "state prepared for rank " + std::to_string(state->rank()) + " but this is rank " +
                      std::to_string(comm.rank()));
  }
  const auto t0 = Clock::now();
  const double cpu0 = CpuSeconds();
  const MemorySnapshot base = ReadMemory();
  PeakSampler sampler;
  RankReport mine;

  auto t = Clock::now();
  // Shared: the file source holds the manifest and the open files through it (FileSource).
  const auto agreed = std::make_shared<Agreement>(Together(
      comm, [&] { return Handshake(comm, state->plan(), {rq.checkpoint, rq.options, rq.mapping}); }));
  const Agreement& a = *agreed;
  const Manifest& m = a.manifest;
  mine.handshake_seconds = Since(t);

  t = Clock::now();
  // The node's cores shared by its ranks (each commits its own shards at once), as the readers share them.
  const int ranks_on_node = OnNode(a.nodes, comm.world_size(), comm.rank(), [](int) { return true; });
  CommitBeside commit;  // joined after the stream (stopped and joined on a failure path)
  Allocate(comm, state, rq.checksum_only || rq.setup_only, ThreadsHere(rq.options, ranks_on_node), &commit);
  mine.allocate_seconds = Since(t);
  mine.setup_cpu_seconds = CpuSeconds() - cpu0;

  const auto route = Route::Make(m.params.source, m.world_size, a.nodes);
  std::unique_ptr<Sink> sink;
  ChecksumSink* checksums = nullptr;
  // A CUDA target's device is current on this thread while the stream runs: the staging ring page-locks its
  // slots there, and a thread of the caller's own (from_pretrained's stream beside the build) starts on
  // device 0, where every rank would otherwise open a context. Restored after (c10's guard opens none).
  c10::OptionalDeviceGuard on_target;
  if (rq.checksum_only || rq.setup_only) {
    auto c = std::make_unique<ChecksumSink>(m.entries.size());
    checksums = c.get();
    sink = std::move(c);
  } else {
    std::vector<at::Tensor> targets = Targets(m, state);
    for (const at::Tensor& x : targets) {
      if (x.defined() && x.is_cuda()) {
        on_target.reset_device(x.device());
        break;
      }
    }
    sink = std::make_unique<ShardSink>(std::move(targets));
  }
  StreamContext ctx;
  ctx.comm = &comm;
  ctx.manifest = &m;
  ctx.route = route.get();
  ctx.source = std::make_shared<FileSource>(std::shared_ptr<const Manifest>(agreed, &a.manifest),
                                            std::shared_ptr<const FileTable>(agreed, &a.files), rq.options.release_pages);
  ctx.sink = sink.get();
  const int readers_on_node = ReadersOnNode(*route, a.nodes, comm.rank(), m.params.verify);
  ctx.readahead_bytes = ReadaheadFor(rq.options, readers_on_node);
  ctx.read_threads = static_cast<uint32_t>(ThreadsHere(rq.options, readers_on_node));
  ctx.pin_staging = rq.options.target == Target::kCuda;
  ctx.progress = rq.progress;

  t = Clock::now();
  StreamResult r;
  if (rq.setup_only) {
    r.stats = PlanStream(ctx);  // the schedule, walked: what the stream would do, with no bytes moved
    r.stats.bytes_read = r.stats.bytes_received = 0;
  } else {
    r = StreamTogether(comm, ctx, "load", "stream", /*name_rank=*/true);
  }
  commit.Stop();  // a commit the readers overtook ends here, inside the stream's time
  mine.commit_threads = commit.threads();
  mine.commit_threads_let_go = commit.let_go();
  commit.Join();
  mine.stream_seconds = Since(t);

  t = Clock::now();
  if (m.params.verify && !rq.setup_only) Together(comm, [&] {
      VerifyDigests(comm, m, r);
      return 0;
    });
  mine.verify_seconds = Since(t);

  const double seconds = Since(t0);
  MemoryPeaks peaks = sampler.Stop();
  auto above = [](uint64_t v, uint64_t b) { return v > b ? v - b : 0; };
  mine.bytes_received = r.stats.bytes_received, mine.bytes_stored = r.stats.bytes_stored;
  mine.bytes_sent = r.stats.bytes_sent, mine.bytes_read = r.stats.bytes_read, mine.messages = r.stats.messages;
  mine.read_threads = r.stats.read_threads, mine.pinned_staging = r.stats.pinned_staging;
  mine.pin_seconds = r.stats.pin_seconds;
  mine.seconds = seconds;
  mine.cpu_seconds = CpuSeconds() - cpu0;
  mine.peak_rss_anon = above(peaks.rss_anon, base.rss_anon), mine.peak_rss_file = above(peaks.rss_file, base.rss_file);
  mine.baseline_rss_anon = base.rss_anon, mine.baseline_rss_file = base.rss_file;
  mine.verified = m.params.verify && !rq.setup_only ? 1 : -1;
  if (rq.checksum_only && checksums != nullptr) mine.digest = checksums->digest();
  LoadReport report;
  report.source = route->name();
  report.source_reason = m.params.source_reason;
  report.target = rq.checksum_only ? "checksum-only" : TargetName(rq.options.target);
  report.backend = comm.backend();
  report.world_size = comm.world_size();
  report.mesh = m.MeshText();
  report.nodes = a.nodes.nodes();
  report.checkpoint_bytes = SourceBytes(m);
  report.entries = m.entries.size();
  report.total_bytes = TotalTargetBytes(m);
  report.skipped_keys = m.skipped;
  report.dequantized = DequantizedEntries(m);
  report.chunk_bytes = m.params.chunk_bytes;
  report.staging_slots = static_cast<int>(m.params.staging_slots);
  report.setup_only = rq.setup_only;
  report.skipped_examples = m.skipped_examples;
  report.adopted = a.adopted;
  report.seconds = seconds;
  report.ranks = Together(comm, [&] { return GatherReports(comm, mine); });
  return report;
}

namespace {

// One row of the load's report: its AllGather and its JSON (runtime/report_fields.h). `verified` and
// `digest` travel too; the JSON writes them as text ("verify", and "digest" in hex for checksum-only).
constexpr ReportField<RankReport> kRankFields[] = {
    {"seconds", &RankReport::seconds},
    {"handshake_seconds", &RankReport::handshake_seconds},
    {"allocate_seconds", &RankReport::allocate_seconds},
    {"stream_seconds", &RankReport::stream_seconds},
    {"verify_seconds", &RankReport::verify_seconds},
    {"cpu_seconds", &RankReport::cpu_seconds},
    {"setup_cpu_seconds", &RankReport::setup_cpu_seconds},
    {"messages", &RankReport::messages},
    {"bytes_received", &RankReport::bytes_received},
    {"bytes_stored", &RankReport::bytes_stored},
    {"bytes_sent", &RankReport::bytes_sent},
    {"bytes_read", &RankReport::bytes_read},
    {"read_threads", &RankReport::read_threads},
    {"commit_threads", &RankReport::commit_threads},
    {"commit_threads_let_go", &RankReport::commit_threads_let_go},
    {"pinned_staging_bytes", &RankReport::pinned_staging},
    {"pin_seconds", &RankReport::pin_seconds},
    {"peak_rss_anon_above_baseline", &RankReport::peak_rss_anon},
    {"peak_rss_file_above_baseline", &RankReport::peak_rss_file},
    {"baseline_rss_anon", &RankReport::baseline_rss_anon},
    {"baseline_rss_file", &RankReport::baseline_rss_file},
    {nullptr, &RankReport::verified},
    {nullptr, &RankReport::digest},
};

}  // namespace

std::vector<RankReport> GatherReports(Communicator& comm, const RankReport& mine) {
  return GatherRows(comm, mine, kRankFields);
}

std::string LoadReport::ToJson() const {
  nlohmann::ordered_json j;
  j["source"] = source;
  j["source_reason"] = source_reason;
  j["target"] = target;
  j["backend"] = backend;
  j["world_size"] = world_size;
  j["mesh"] = mesh;
  j["nodes"] = nodes;
  j["checkpoint_bytes"] = checkpoint_bytes;
  j["entries"] = entries;
  j["total_bytes"] = total_bytes;
  j["skipped_keys"] = skipped_keys;
  j["dequantized"] = dequantized;
  j["chunk_bytes"] = chunk_bytes;
  j["staging_slots"] = staging_slots;
  j["setup_only"] = setup_only;
  j["skipped_examples"] = skipped_examples;
  j["adopted"] = adopted;
  j["ranks"] = nlohmann::json::array();
  for (const auto& rr : ranks) {
    j["ranks"].push_back(RowJson(rr, kRankFields));
    j["ranks"].back()["verify"] = rr.verified == 1 ? "ok" : "off";
    if (target == "checksum-only") {  // hex: JSON readers lose integers past 2^53
      char hex[17];
      std::snprintf(hex, sizeof hex, "%016llx", static_cast<unsigned long long>(rr.digest));
      j["ranks"].back()["digest"] = hex;
    }
  }
  return j.dump(2, ' ', false, nlohmann::json::error_handler_t::replace);
}

}  // namespace shardcast
