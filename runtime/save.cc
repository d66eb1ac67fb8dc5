#include "runtime/save.h"

#include <chrono>
#include <nlohmann/json.hpp>
#include <optional>

#include "allocators/error.h"
#include "allocators/memory_probe.h"
#include "loaders/writer.h"
#include "runtime/agree/agreement.h"
#include "runtime/agree/failure.h"
#include "runtime/agree/fault.h"
#include "runtime/agree/verdict.h"
#include "runtime/engine/file_sink.h"
#include "runtime/engine/shard_source.h"
#include "runtime/engine/stream.h"
#include "runtime/report_fields.h"
#include "runtime/save_layout.h"

namespace shardcast {
namespace {

using Clock = std::chrono::steady_clock;

double Since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

void AgreeTogether(Communicator& comm, const char* phase, const Problem& local) {
  Together(
      comm,
      [&] {
        Agree(comm, phase, local);
        return 0;
      },
      "save");
}

// Runs a rank-local step and returns its failure as a Problem (empty on success).
template <typename F>
Problem Try(F&& step) {
  try {
    step();
  } catch (const std::exception& e) {
    return AsProblem(e);
  }
  return {};
}

// The sources save has (source=, formerly mode=). A load's other sources (node-leader, striped) are refused by every rank in the
// layout's verdict, never run as another mode.
Problem CheckMode(const SaveRequest& rq) {
  const Source s = rq.options.source;
  if (s == Source::kAuto || s == Source::kRank0 || s == Source::kEachRank) return {};
  return {ErrorKind::kInvalidArgument, "source \"" + std::string(SourceName(s)) +
                                           "\" is not a save source: save writes with \"each-rank\" or \"rank0\""};
}

// Step 1: rank 0 decides the layout, every rank checks it; one verdict (runtime/agree/agreement.h).
Agreed DecideTogether(Communicator& comm, const Plan& plan, const SaveRequest* rq, Problem local) {
  Agreed a;
  Deciding d;
  d.phase = "save layout";
  d.decide = [&](const Facts&) {
    a = Decide(plan, *rq, comm.world_size());
    nlohmann::json h = Params(*rq);
    h["tmp_dir"] = a.tmp_dir;
    return h.dump() + '\0' + EncodeManifest(a.manifest);
  };
  d.check = [&](const std::string& blob, const Facts&) {
    const int me = comm.rank();
    const size_t nul = blob.find('\0');
    if (nul == std::string::npos) throw Error(ErrorKind::kComm, "save layout", "malformed layout from rank 0");
    const nlohmann::json h = nlohmann::json::parse(blob.substr(0, nul));
    if (me != 0) {
      a.manifest = DecodeManifest(blob.substr(nul + 1));
      a.out_dir = h.at("out_dir").get<std::string>();
      a.tmp_dir = h.at("tmp_dir").get<std::string>();
    }
    std::string diff = CheckManifest(a.manifest, plan, me, comm.world_size());
    if (!diff.empty()) throw Error(ErrorKind::kManifestMismatch, "", diff);
    diff = CheckParams(h, *rq, me);
    if (!diff.empty()) throw Error(ErrorKind::kInvalidArgument, "", diff);
  };
  Together(
      comm,
      [&] {
        DecideAndAgree(comm, d, std::move(local));
        return 0;
      },
      "save");
  return a;
}

std::vector<at::Tensor> Shards(const Manifest& m, RankState* state) {
  std::vector<at::Tensor> out(m.entries.size());
  size_t cursor = 0;
  for (size_t i = 0; i < m.entries.size(); ++i) {
    LocalTensor* t = state->FindNext(m.entries[i].key, &cursor);
    if (t == nullptr || t->is_meta()) throw Error(ErrorKind::kInternal, std::string(m.entries[i].key), "agreed but has no storage");
    out[i] = t->tensor;
  }
  return out;
}

// Steps 2-5, after the layout was agreed. Rank 0 removes its tmp directory if any of them fails.
// `hold`: rank 0's hold on the build directory, kept by the caller until the save ends.
void Write(Communicator& comm, RankState* state, const SaveRequest& rq, const Agreed& a, SaveRankReport* mine,
           StreamStats* stats, output_dir::BuildHold* hold) {
  const Manifest& m = a.manifest;
  const int me = comm.rank();
  const bool each_rank = m.params.source == Source::kEachRank;
  auto t = Clock::now();
  AgreeTogether(comm, "save create", me != 0 ? Problem{} : Try([&] {
    for (const std::string& old : a.leftovers) {
      if (!output_dir::Held(old)) output_dir::RemoveTree(old);  // a save that began since is left alone
    }
    *hold = output_dir::Create(a.tmp_dir, m.files, a.headers);
  }));
  FileSink sink(m, a.tmp_dir, me);
  std::shared_ptr<ShardSource> source;
  AgreeTogether(comm, "save open", Try([&] {
    if (me == 0 || each_rank) sink.Open();
    source = std::make_shared<ShardSource>(Shards(m, state));
  }));
  mine->create_seconds = Since(t);

  t = Clock::now();
  const auto route =
      Route::MakeSave(each_rank ? Route::SaveMode::kEachWriter : Route::SaveMode::kCollector, comm.world_size());
  StreamContext ctx;
  ctx.comm = &comm;
  ctx.manifest = &m;
  ctx.route = route.get();
  ctx.source = source;
  ctx.sink = &sink;
  ctx.readahead_bytes = 0;  // the source is memory
  ctx.progress = rq.progress;
  *stats = StreamTogether(comm, ctx, "save", "save stream", /*name_rank=*/false).stats;
  mine->stream_seconds = Since(t);

  t = Clock::now();
  AgreeTogether(comm, "save write", Try([&] { sink.Sync(); }));
  mine->bytes_written = sink.bytes_written(), mine->files_written = sink.files_written();
  mine->sync_seconds = Since(t);

  t = Clock::now();
  FaultPoint("save-commit", me);
  bool committed = false;
  const Problem local = me != 0 ? Problem{} : Try([&] {
    if (!a.index.empty()) output_dir::WriteText(a.tmp_dir, "model.safetensors.index.json", a.index);
    if (!rq.config_json.empty()) output_dir::WriteText(a.tmp_dir, "config.json", rq.config_json);
    if (!rq.generation_config_json.empty()) {
      output_dir::WriteText(a.tmp_dir, "generation_config.json", rq.generation_config_json);
    }
    if (rq.keep_other_files) output_dir::CarryOver(a.out_dir, a.tmp_dir);
    output_dir::Commit(a.tmp_dir, a.out_dir);
    committed = true;
  });
  try {
    Agree(comm, "save commit", local);
  } catch (const Error& e) {
    if (!IsCommFailure(e)) throw;
    // A rank lost after every byte was synced: rank 0 (which publishes first) says whether it had
    // already put the complete checkpoint in place, so every rank raises that.
    if (!committed) FailTogether(comm, e, "save");
    FailTogether(comm, Error(e.kind(), "", std::string(e.what()) + " (after every rank synced its bytes; rank 0 had "
                                               "committed " + a.out_dir + ", which is complete)"),
                 "save");
  }
  mine->commit_seconds = Since(t);
}

// One row of the save's report: its AllGather and its JSON (runtime/report_fields.h).
constexpr ReportField<SaveRankReport> kRankFields[] = {
    {"seconds", &SaveRankReport::seconds},
    {"layout_seconds", &SaveRankReport::layout_seconds},
    {"create_seconds", &SaveRankReport::create_seconds},
    {"stream_seconds", &SaveRankReport::stream_seconds},
    {"sync_seconds", &SaveRankReport::sync_seconds},
    {"commit_seconds", &SaveRankReport::commit_seconds},
    {"bytes_written", &SaveRankReport::bytes_written},
    {"files_written", &SaveRankReport::files_written},
    {"bytes_sent", &SaveRankReport::bytes_sent},
    {"bytes_received", &SaveRankReport::bytes_received},
    {"bytes_read", &SaveRankReport::bytes_read},
    {"peak_rss_anon_above_baseline", &SaveRankReport::peak_rss_anon},
    {"peak_rss_file_above_baseline", &SaveRankReport::peak_rss_file},
    {"baseline_rss_anon", &SaveRankReport::baseline_rss_anon},
    {"baseline_rss_file", &SaveRankReport::baseline_rss_file},
};

}  // namespace

void FailSave(Communicator& comm, ErrorKind kind, const std::string& problem) {
  DecideTogether(comm, Plan{}, nullptr, Problem{kind, problem});
  throw Error(kind, "save layout", problem);  // not reached: the verdict throws for a problem
}

SaveReport Save(Communicator& comm, RankState* state, const SaveRequest& rq) {
  if (state->rank() != comm.rank()) {
    FailSave(comm, ErrorKind::kInvalidArgument,
             "state prepared for rank " + std::to_string(state->rank()) + " but this is rank " +
                 std::to_string(comm.rank()));
  }
  const auto t0 = Clock::now();
  const MemorySnapshot base = ReadMemory();
  PeakSampler sampler;
  SaveRankReport mine;
  mine.rank = comm.rank();

  Agreed a = DecideTogether(comm, state->plan(), &rq, CheckMode(rq));
  mine.layout_seconds = Since(t0);
  StreamStats stats;
  output_dir::BuildHold hold;  // rank 0's, on the build directory: released when the save ends
  try {
    Write(comm, state, rq, a, &mine, &stats, &hold);
  } catch (...) {
    // Rank 0 removes what it created (after a commit: the old tree, if any), then, where the failure
    // was an agreed verdict (the communicator still works), every rank waits for that, so nothing is
    // left once any rank raises. A failed communicator fails the barrier at once.
    if (comm.rank() == 0) output_dir::RemoveTree(a.tmp_dir);
    try {
      comm.Barrier();
    } catch (...) {
    }
    throw;
  }
  const Manifest& m = a.manifest;
  const MemoryPeaks peaks = sampler.Stop();
  auto above = [](uint64_t v, uint64_t b) { return v > b ? v - b : 0; };
  mine.bytes_sent = stats.bytes_sent, mine.bytes_received = stats.bytes_received, mine.bytes_read = stats.bytes_read;
  mine.seconds = Since(t0);
  mine.peak_rss_anon = above(peaks.rss_anon, base.rss_anon), mine.peak_rss_file = above(peaks.rss_file, base.rss_file);
  mine.baseline_rss_anon = base.rss_anon, mine.baseline_rss_file = base.rss_file;

  SaveReport report;
  report.out_dir = a.out_dir;
  report.mode = SourceName(m.params.source);
  report.backend = comm.backend();
  report.world_size = comm.world_size();
  report.entries = m.entries.size();
  for (const ManifestEntry& e : m.entries) {
    report.tensors += e.parts.size();
    for (const ManifestPart& p : e.parts) report.total_bytes += p.numel * DTypeSize(p.source_dtype);
  }
  for (const ManifestFile& f : m.files) report.files.push_back(f.name);
  report.chunk_bytes = m.params.chunk_bytes;
  report.staging_slots = static_cast<int>(m.params.staging_slots);
  report.seconds = mine.seconds;
  report.ranks = Together(comm, [&] { return GatherRows(comm, mine, kRankFields); });
  return report;
}

std::string SaveReport::ToJson() const {
  nlohmann::ordered_json j;
  j["out_dir"] = out_dir;
  j["mode"] = mode;
  j["backend"] = backend;
  j["world_size"] = world_size;
  j["entries"] = entries;
  j["tensors"] = tensors;
  j["total_bytes"] = total_bytes;
  j["files"] = files;
  j["chunk_bytes"] = chunk_bytes;
  j["staging_slots"] = staging_slots;
  j["seconds"] = seconds;
  j["ranks"] = nlohmann::json::array();
  for (const auto& r : ranks) j["ranks"].push_back(RowJson(r, kRankFields));
  return j.dump(2, ' ', false, nlohmann::json::error_handler_t::replace);
}

}  // namespace shardcast
