#include "runtime/handshake.h"

#include <algorithm>
#include <cstdio>
#include <unordered_map>

#include "allocators/error.h"
#include "loaders/quantization.h"
#include "runtime/agree/agreement.h"
#include "runtime/agree/fault.h"
#include "runtime/stream/route.h"

namespace shardcast {
namespace {

OpenOptions FileOptions(const HandshakeRequest& rq) {
  OpenOptions oo;
  oo.mode = rq.options.pread ? ReadMode::kPread : ReadMode::kMmap;
  return oo;
}

// Rank 0's files, opened by a rank the route has read: no index, no header parsed again.
std::unique_ptr<Checkpoint> OpenManifestFiles(const HandshakeRequest& rq, const Manifest& m) {
  std::vector<Checkpoint::KnownFile> known;
  known.reserve(m.files.size());
  for (const ManifestFile& f : m.files) known.push_back({f.name, f.size, f.digest});
  return Checkpoint::OpenKnown(rq.checkpoint, known, FileOptions(rq));
}

// What every rank says first: its node and what it sees of the checkpoint (-1: nothing).
std::vector<int64_t> Hello(const std::string& checkpoint) {
  return {LocalNodeKey(), checkpoint.empty() ? -1 : ProbeCheckpoint(checkpoint)};
}
NodeMap Nodes(const Facts& hello) {
  std::vector<long long> keys;
  for (const auto& row : hello) keys.push_back(row[0]);
  return NodeMapFromKeys(keys);
}
std::vector<int64_t> Probes(const Facts& hello) {
  std::vector<int64_t> out;
  for (const auto& row : hello) out.push_back(row[1]);
  return out;
}

StreamParams DecideParams(const LoadOptions& options, const std::vector<int64_t>& probes, const NodeMap& nodes,
                          const Plan& plan) {
  StreamParams p = StreamParamsFrom(options);
  if (p.source != Source::kAuto) {
    p.source_reason = "asked for";
    return p;
  }
  SourceChoice c = ChooseSource(probes, nodes, ShardCopies(plan));
  p.source = c.source;
  p.source_reason = "auto: " + c.reason;
  return p;
}

// This rank's files, matched to rank 0's by name, size, header digest and data samples; "" or the difference.
std::string MatchFiles(const Manifest& m, const Checkpoint& ckpt, const std::string& root, int rank, FileTable* out) {
  std::unordered_map<std::string, size_t> mine;
  for (size_t i = 0; i < ckpt.num_files(); ++i) mine.emplace(RelativeName(ckpt, i), i);
  const std::string who = "rank " + std::to_string(rank);
  out->clear();
  for (const ManifestFile& f : m.files) {
    auto it = mine.find(f.name);
    if (it == mine.end()) {
      return "file '" + f.name + "': rank 0's checkpoint has it but " + who + "'s view of " + root +
             " does not (ranks must see the same checkpoint)";
    }
    const SafetensorsFile& file = ckpt.file(it->second);
    if (file.file_size() != f.size) {
      return "file '" + f.name + "' in " + root + ": " + std::to_string(f.size) + " bytes on rank 0 but " +
             std::to_string(file.file_size()) + " on " + who;
    }
    if (FileDigest(file) != f.digest) {
      return "file '" + f.name + "' in " + root + ": its header differs between rank 0 and " + who +
             " (same size, other tensors or offsets)";
    }
    if (f.sample != 0 && file.SampleDigest() != f.sample) {
      return "file '" + f.name + "' in " + root + ": its data differs between rank 0 and " + who +
             " (the same tensors with other values: another checkpoint, such as another step of the run; ranks "
             "must load the same checkpoint)";
    }
    out->push_back(&file);
  }
  return {};
}

std::vector<std::string> Adopted(const StreamParams& reader, const LoadOptions& mine) {
  std::vector<std::string> out;
  auto note = [&](const std::string& name, const std::string& theirs, const std::string& ours) {
    if (theirs != ours) out.push_back(name + " " + theirs + " (rank 0's; this rank asked for " + ours + ")");
  };
  if (mine.source != Source::kAuto) note("source", SourceName(reader.source), SourceName(mine.source));
  note("chunk_bytes", std::to_string(reader.chunk_bytes), std::to_string(mine.chunk_bytes));
  note("staging_slots", std::to_string(reader.staging_slots), std::to_string(mine.staging_slots));
  return out;
}

std::string BlockText(const BlockSize& b) { return std::to_string(b.rows) + "x" + std::to_string(b.cols); }

// How the checkpoint was quantized: its own config.json says (quantization_config.weight_block_size),
// else the model's config, else the caller's weight_block_size, else 128 x 128. Decided by rank 0 and
// carried in the manifest. A quant_method shardcast does not read is a kCheckpoint error
// (loaders/quantization.h).
struct DecidedBlock {
  BlockSize block;
  std::string config;  // the config.json that named it; "" where none did
};
DecidedBlock WeightBlock(const std::string& checkpoint, const ModelSpec& spec, const std::optional<BlockSize>& asked) {
  if (auto config = ReadCheckpointConfig(checkpoint)) {
    const std::string source = checkpoint + "/config.json";
    CheckQuantMethod(source, *config);
    if (auto b = ConfigWeightBlockSize(source, *config)) return {*b, source};
  }
  if (auto b = ConfigWeightBlockSize(spec.source, spec.config_json)) return {*b, spec.source};
  return {asked.value_or(BlockSize{}), ""};
}

bool SameBlock(const BlockSize& a, const BlockSize& b) { return a.rows == b.rows && a.cols == b.cols; }

// The first fp8 part the manifest dequantizes (the only parts a weight block shapes), with its key.
const ManifestPart* FirstFp8Dequantized(const Manifest& m, std::string_view* key) {
  for (const ManifestEntry& e : m.entries) {
    for (const ManifestPart& p : e.parts) {
      if (p.dequantize && p.scale && p.packing == Packing::kNone) {
        *key = e.key;
        return &p;
      }
    }
  }
  return nullptr;
}

// Rank 0: a block the caller asked for that the config contradicts, where an fp8 part is dequantized (its
// scales were made in the config's blocks): kInvalidArgument naming both. A load that dequantizes no fp8
// part is not shaped by the block, so nothing is asked of it.
void CheckAskedBlock(const Manifest& m, const DecidedBlock& decided, const std::optional<BlockSize>& asked) {
  std::string_view key;
  if (!asked || decided.config.empty() || SameBlock(*asked, decided.block) || !FirstFp8Dequantized(m, &key)) return;
  throw Error(ErrorKind::kInvalidArgument, "weight_block_size",
              BlockText(*asked) + " was asked for, but " + decided.config +
                  " says quantization_config.weight_block_size is [" + std::to_string(decided.block.rows) + ", " +
                  std::to_string(decided.block.cols) + "]: the checkpoint's scales (key '" + std::string(key) +
                  "') are in its blocks");
}

// A block this rank asked for that is not the one rank 0's manifest dequantizes fp8 parts in: "" where
// they agree, or where no fp8 part is dequantized.
std::string CheckBlock(const Manifest& m, const std::optional<BlockSize>& asked, int rank) {
  std::string_view key;
  const ManifestPart* p = asked ? FirstFp8Dequantized(m, &key) : nullptr;
  if (p == nullptr || SameBlock(p->scale->block, *asked)) return {};
  return "the agreed fp8 block is " + BlockText(p->scale->block) + " (key '" + std::string(key) +
         "': rank 0's config.json or weight_block_size) but rank " + std::to_string(rank) + " asked for " +
         BlockText(*asked) + " (every rank must ask for the same)";
}

}  // namespace

Agreement Handshake(Communicator& comm, const Plan& plan, const HandshakeRequest& rq, Problem failed) {
  if (failed.message.empty()) FaultPoint("handshake", comm.rank());
  Agreement a;
  Deciding d;
  d.phase = "handshake";
  d.facts = Hello(failed.message.empty() ? rq.checkpoint : std::string());
  d.decide = [&](const Facts& hello) {
    a.nodes = Nodes(hello);
    a.ckpt = Checkpoint::Open(rq.checkpoint, FileOptions(rq));
    const DecidedBlock block = WeightBlock(rq.checkpoint, plan.spec(), rq.options.weight_block);
    a.manifest = Resolve(plan, *a.ckpt, rq.mapping, DecideParams(rq.options, Probes(hello), a.nodes, plan),
                         block.block);
    CheckAskedBlock(a.manifest, block, rq.options.weight_block);
    return EncodeManifest(a.manifest);
  };
  d.check = [&](const std::string& blob, const Facts& hello) {
    const int me = comm.rank();
    a.nodes = Nodes(hello);
    if (me != 0) a.manifest = DecodeManifest(blob);
    std::string diff = CheckManifest(a.manifest, plan, me, comm.world_size());
    if (diff.empty()) diff = CheckParams(a.manifest.params, rq.options, me);
    if (diff.empty()) diff = CheckBlock(a.manifest, rq.options.weight_block, me);
    if (!diff.empty()) throw Error(ErrorKind::kManifestMismatch, "", diff);
    const auto route = Route::Make(a.manifest.params.source, a.manifest.world_size, a.nodes);
    if (route->Reads(me, a.manifest.params.verify)) {
      if (!a.ckpt) a.ckpt = OpenManifestFiles(rq, a.manifest);
      diff = MatchFiles(a.manifest, *a.ckpt, rq.checkpoint, me, &a.files);
      if (!diff.empty()) throw Error(ErrorKind::kManifestMismatch, "", diff);
    }
    a.adopted = Adopted(a.manifest.params, rq.options);
  };
  DecideAndAgree(comm, d, std::move(failed));
  return a;
}

void FailHandshake(Communicator& comm, ErrorKind kind, const std::string& problem) {
  Handshake(comm, Plan{}, HandshakeRequest{}, Problem{kind, problem});
  throw Error(kind, "handshake", problem);  // not reached: the verdict throws for a problem
}

SourceChoice ChooseSource(const std::vector<int64_t>& probes, const NodeMap& nodes, double copies) {
  // A rank that sees no checkpoint at its path is blind: it is served. One that sees another size (another
  // index, another file) sees a checkpoint all the same: it reads its own, and the handshake's file match
  // (sizes, headers, samples) says whether it is rank 0's. (Taken for blind, it was served rank 0's values
  // where it had been given other ones, and an index rewritten over the same files would be refused.)
  std::vector<int> blind;
  for (size_t r = 0; r < probes.size(); ++r) {
    if (probes[r] < 0) blind.push_back(static_cast<int>(r));
  }
  const int n = nodes.nodes();
  if (blind.empty()) {
    if (n <= 1) return {Source::kEachRank, "every rank sees the checkpoint, on one node"};
    char text[160];
    if (copies >= 1.5) {
      std::snprintf(text, sizeof(text), "every rank sees the checkpoint, on %d nodes, %.1f copies of each shard (HSDP)",
                    n, copies);
      return {Source::kStriped, text};
    }
    std::snprintf(text, sizeof(text), "every rank sees the checkpoint, on %d nodes", n);
    return {Source::kNodeLeader, text};
  }
  const std::string who = "rank(s) " + RankList(blind) + " do not see it as rank 0 does";
  bool leaders_see = n > 1;
  for (int node = 0; node < n && leaders_see; ++node) {
    leaders_see = std::find(blind.begin(), blind.end(), nodes.LeaderOf(node)) == blind.end();
  }
  if (leaders_see) return {Source::kNodeLeader, who + "; the first rank of every node does"};
  return {Source::kRank0, who};
}

double ShardCopies(const Plan& plan) {
  double bytes = 0, held = 0;
  for (const PlanEntry& e : plan.entries()) {
    if (e.replicated()) continue;
    double copies = 1;
    for (size_t d = 0; d < e.layout->placements.size(); ++d) {
      if (e.layout->placements[d].kind == Placement::kReplicate) copies *= e.layout->mesh_shape[d];
    }
    bytes += static_cast<double>(e.nbytes());
    held += copies * static_cast<double>(e.nbytes());
  }
  return bytes > 0 ? held / bytes : 1.0;
}

}  // namespace shardcast
