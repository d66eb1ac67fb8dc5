#include "runtime/load.h"

#include <chrono>
#include <cstring>
#include <nlohmann/json.hpp>

#include "allocators/error.h"
#include "runtime/verdict.h"

namespace shardcast {
namespace {

using Clock = std::chrono::steady_clock;

Problem AsProblem(const std::exception& e) {
  if (auto* se = dynamic_cast<const Error*>(&e)) return Problem{se->kind(), se->what()};
  return Problem{ErrorKind::kInternal, e.what()};
}

// Rank 0 (or every rank for each-rank) opens and resolves; everyone learns the manifest.
struct Handshake {
  std::unique_ptr<Checkpoint> ckpt;
  Manifest manifest;
};

Handshake RunHandshake(Communicator& comm, const Plan& plan, const LoadRequest& rq) {
  Handshake h;
  Problem local;
  const bool reader = comm.rank() == 0;
  const bool each = rq.options.source == Source::kEachRank;
  std::string blob;
  if (reader || each) {
    try {
      OpenOptions oo;
      oo.mode = rq.options.pread ? ReadMode::kPread : ReadMode::kMmap;
      h.ckpt = Checkpoint::Open(rq.checkpoint, oo);
      if (reader) {
        h.manifest = Resolve(plan, *h.ckpt, rq.mapping, rq.extra_keys);
        blob = h.manifest.Serialize();
      }
    } catch (const std::exception& e) {
      local = AsProblem(e);
      blob.clear();
    }
  }
  // The manifest goes out even when rank 0 failed (as nothing), so every rank runs the same
  // collectives and reaches the verdict.
  int64_t size = static_cast<int64_t>(blob.size());
  comm.Broadcast(&size, sizeof(size), 0);
  if (!reader) blob.resize(static_cast<size_t>(size));
  comm.Broadcast(blob.data(), blob.size(), 0);
  if (local.message.empty() && size > 0) {
    try {
      if (!reader) h.manifest = Manifest::Deserialize(blob);
      std::string diff = CheckManifest(h.manifest, plan, comm.rank(), comm.world_size());
      if (!diff.empty()) local = Problem{ErrorKind::kManifestMismatch, diff};
      if (each && !reader && local.message.empty()) {  // this rank's view of the files must be rank 0's
        for (const ManifestEntry& e : h.manifest.entries) {
          for (const ManifestPart& p : e.parts) {
            const Checkpoint::Entry* mine = h.ckpt->Find(p.checkpoint_key);
            uint64_t off = mine ? mine->file->header().data_offset() + mine->info->begin : 0;
            if (!mine || mine->info->dtype != p.source_dtype || mine->info->numel() != p.numel || off != p.offset ||
                mine->file->path() != h.manifest.files[p.file]) {
              local = Problem{ErrorKind::kManifestMismatch,
                              "key '" + p.checkpoint_key + "': rank " + std::to_string(comm.rank()) +
                                  "'s view of the checkpoint " + rq.checkpoint +
                                  " differs from rank 0's (missing, or another dtype, size, file or offset)"};
              break;
            }
          }
          if (!local.message.empty()) break;
        }
      }
    } catch (const std::exception& e) {
      local = AsProblem(e);
    }
  }
  Agree(comm, "handshake", local);
  return h;
}

// Every rank raises the same message for a failure in the stream. Rank 0 drives the stream and knows
// the most (a bad file, which peer died), so it publishes at once; any other rank first waits briefly
// for what was published and raises that, and publishes its own cause only if nothing comes.
[[noreturn]] void FailTogether(Communicator& comm, const std::exception& e) {
  Problem p = AsProblem(e);
  const bool comm_failure = p.kind == ErrorKind::kComm || p.kind == ErrorKind::kCommTimeout;
  if (!comm_failure) p.message = "rank " + std::to_string(comm.rank()) + ": " + p.message;
  if (comm.rank() != 0 && comm_failure) {
    if (auto published = comm.FetchFailure(std::chrono::milliseconds(3000))) {
      p.kind = published->first;
      p.message = published->second;
    } else {
      comm.PublishFailure(p.kind, p.message);
    }
  } else {
    comm.PublishFailure(p.kind, p.message);
  }
  comm.Abort();  // peers blocked on us fail now, and fetch the message
  if (comm.rank() == 0) comm.AwaitFailureAcks(comm.world_size() - 1, std::chrono::milliseconds(3000));
  throw Error(p.kind, "load", p.message);
}

void Verify(Communicator& comm, const Manifest& m, const StreamStats& st) {
  const int world = comm.world_size();
  std::vector<uint64_t> expected = comm.rank() == 0 ? st.digests : std::vector<uint64_t>(m.entries.size() * world);
  comm.Broadcast(expected.data(), expected.size() * sizeof(uint64_t), 0);
  Problem local;
  const int me = comm.rank();
  for (size_t i = 0; i < m.entries.size() && local.message.empty(); ++i) {
    uint64_t want = expected[i * world + me];
    uint64_t got = me == 0 ? st.digests[i * world] : st.digests[i];
    if (want != got) {
      char buf[256];
      std::snprintf(buf, sizeof(buf), "key '%s': checksum %016llx on rank %d, but the sender's is %016llx",
                    m.entries[i].key.c_str(), static_cast<unsigned long long>(got), me,
                    static_cast<unsigned long long>(want));
      local = Problem{ErrorKind::kComm, buf};
    }
  }
  Agree(comm, "verify", local);
}

}  // namespace

void FailHandshake(Communicator& comm, ErrorKind kind, const std::string& problem) {
  int64_t size = 0;
  comm.Broadcast(&size, sizeof(size), 0);  // rank 0's manifest size; ours carries nothing if we are rank 0
  std::string blob(static_cast<size_t>(comm.rank() == 0 ? 0 : size), '\0');
  comm.Broadcast(blob.data(), blob.size(), 0);
  Agree(comm, "handshake", Problem{kind, problem});
  throw Error(kind, "handshake", problem);  // not reached: Agree throws for a non-empty problem
}

LoadReport Load(Communicator& comm, RankState* state, const LoadRequest& rq) {
  if (state->rank() != comm.rank()) {
    FailHandshake(comm, ErrorKind::kInvalidArgument,
                  "state prepared for rank " + std::to_string(state->rank()) + " but this is rank " +
                      std::to_string(comm.rank()));
  }
  const auto t0 = Clock::now();
  const MemorySnapshot base = ReadMemory();
  PeakSampler sampler;
  // A collective that fails in any phase goes through the same protocol as the stream's failures, so
  // a peer that dies during the handshake or the verify is one message on every rank too.
  auto together = [&comm](const Error& e) {
    if (e.kind() == ErrorKind::kComm || e.kind() == ErrorKind::kCommTimeout) FailTogether(comm, e);
    throw;
  };
  Handshake h;
  try {
    h = RunHandshake(comm, state->plan(), rq);
  } catch (const Error& e) {
    together(e);
  }
  // Agreed: allocate only now, so a failed handshake commits nothing.
  StreamTargets targets;
  targets.tensors.resize(h.manifest.entries.size());
  if (!rq.checksum_only) state->AllocateShards();
  for (size_t i = 0; i < h.manifest.entries.size() && !rq.checksum_only; ++i) {
    LocalTensor* t = state->Find(h.manifest.entries[i].key);
    if (t == nullptr) throw Error(ErrorKind::kInternal, h.manifest.entries[i].key, "agreed but not prepared");
    targets.tensors[i] = t->tensor;
  }
  StreamStats st;
  try {
    st = rq.options.source == Source::kRank0
             ? StreamRank0(comm, h.manifest, h.ckpt.get(), targets, rq.options, rq.progress)
             : StreamEachRank(comm, h.manifest, *h.ckpt, targets, rq.options);
    comm.Barrier();
  } catch (const std::exception& e) {
    FailTogether(comm, e);
  }
  try {
    if (rq.options.verify) Verify(comm, h.manifest, st);
  } catch (const Error& e) {
    together(e);
  }
  const double seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  MemoryPeaks peaks = sampler.Stop();
  auto above = [](uint64_t v, uint64_t b) { return v > b ? v - b : 0; };
  RankReport mine;
  mine.bytes_received = st.bytes_received, mine.bytes_stored = st.bytes_stored;
  mine.bytes_sent = st.bytes_sent, mine.bytes_read = st.bytes_read, mine.seconds = seconds;
  mine.peak_rss_anon = above(peaks.rss_anon, base.rss_anon), mine.peak_rss_file = above(peaks.rss_file, base.rss_file);
  mine.baseline_rss_anon = base.rss_anon, mine.baseline_rss_file = base.rss_file;
  mine.verified = rq.options.verify ? 1 : -1;
  LoadReport r;
  r.source = SourceName(rq.options.source);
  r.target = rq.checksum_only ? "checksum-only" : TargetName(rq.options.target);
  r.backend = comm.backend();
  r.world_size = comm.world_size();
  r.entries = h.manifest.entries.size();
  r.total_bytes = TotalTargetBytes(h.manifest, comm.world_size());
  r.skipped_keys = h.manifest.skipped;
  r.chunk_bytes = rq.options.chunk_bytes;
  r.staging_slots = rq.options.staging_slots;
  r.skipped_examples = h.manifest.skipped_examples;
  r.seconds = seconds;
  r.ranks = GatherReports(comm, mine);
  return r;
}

std::vector<RankReport> GatherReports(Communicator& comm, const RankReport& m) {
  auto all = AllGather(comm, {static_cast<int64_t>(m.bytes_received), static_cast<int64_t>(m.bytes_stored),
                              static_cast<int64_t>(m.bytes_sent), static_cast<int64_t>(m.bytes_read),
                              static_cast<int64_t>(m.seconds * 1e6), static_cast<int64_t>(m.peak_rss_anon),
                              static_cast<int64_t>(m.peak_rss_file), static_cast<int64_t>(m.baseline_rss_anon),
                              static_cast<int64_t>(m.baseline_rss_file), m.verified});
  std::vector<RankReport> out;
  for (int i = 0; i < comm.world_size(); ++i) {
    const auto& v = all[i];
    RankReport rr;
    rr.rank = i;
    rr.bytes_received = v[0], rr.bytes_stored = v[1], rr.bytes_sent = v[2], rr.bytes_read = v[3];
    rr.seconds = v[4] / 1e6;
    rr.peak_rss_anon = v[5], rr.peak_rss_file = v[6], rr.baseline_rss_anon = v[7], rr.baseline_rss_file = v[8];
    rr.verified = static_cast<int>(v[9]);
    out.push_back(rr);
  }
  return out;
}

std::string LoadReport::ToJson() const {
  nlohmann::ordered_json j;
  j["source"] = source;
  j["target"] = target;
  j["backend"] = backend;
  j["world_size"] = world_size;
  j["entries"] = entries;
  j["total_bytes"] = total_bytes;
  j["skipped_keys"] = skipped_keys;
  j["chunk_bytes"] = chunk_bytes;
  j["staging_slots"] = staging_slots;
  j["skipped_examples"] = skipped_examples;
  j["ranks"] = nlohmann::json::array();
  for (const auto& rr : ranks) {
    j["ranks"].push_back({{"rank", rr.rank}, {"seconds", rr.seconds}, {"bytes_received", rr.bytes_received},
                          {"bytes_stored", rr.bytes_stored}, {"bytes_sent", rr.bytes_sent}, {"bytes_read", rr.bytes_read},
                          {"peak_rss_anon_above_baseline", rr.peak_rss_anon},
                          {"peak_rss_file_above_baseline", rr.peak_rss_file},
                          {"baseline_rss_anon", rr.baseline_rss_anon}, {"baseline_rss_file", rr.baseline_rss_file},
                          {"verify", rr.verified == 1 ? "ok" : "off"}});
  }
  return j.dump(2);
}

}  // namespace shardcast
