#include "runtime/handshake.h"

#include <unordered_map>

#include "allocators/error.h"
#include "loaders/quantization.h"
#include "runtime/fault.h"
#include "runtime/route.h"
#include "runtime/verdict.h"

namespace shardcast {
namespace {

Problem AsProblem(const std::exception& e) {
  if (auto* se = dynamic_cast<const Error*>(&e)) return Problem{se->kind(), se->what()};
  return Problem{ErrorKind::kInternal, e.what()};
}

std::unique_ptr<Checkpoint> OpenCheckpoint(const HandshakeRequest& rq) {
  OpenOptions oo;
  oo.mode = rq.options.pread ? ReadMode::kPread : ReadMode::kMmap;
  return Checkpoint::Open(rq.checkpoint, oo);
}

// This rank's files, matched to rank 0's by name, size and header digest; "" or the difference.
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
    out->push_back(&file);
  }
  return {};
}

std::vector<std::string> Adopted(const StreamParams& reader, const LoadOptions& mine) {
  std::vector<std::string> out;
  auto note = [&](const std::string& name, const std::string& theirs, const std::string& ours) {
    if (theirs != ours) out.push_back(name + " " + theirs + " (rank 0's; this rank asked for " + ours + ")");
  };
  note("source", SourceName(reader.source), SourceName(mine.source));
  note("chunk_bytes", std::to_string(reader.chunk_bytes), std::to_string(mine.chunk_bytes));
  note("staging_slots", std::to_string(reader.staging_slots), std::to_string(mine.staging_slots));
  return out;
}

// How the checkpoint was quantized: its own config.json says (quantization_config.weight_block_size),
// else the model's config, else 128 x 128. Decided by rank 0 and carried in the manifest. A
// quant_method shardcast does not read is a kCheckpoint error (loaders/quantization.h).
BlockSize WeightBlock(const std::string& checkpoint, const ModelSpec& spec) {
  if (auto config = ReadCheckpointConfig(checkpoint)) {
    CheckQuantMethod(checkpoint + "/config.json", *config);
    if (auto b = ConfigWeightBlockSize(checkpoint + "/config.json", *config)) return *b;
  }
  if (auto b = ConfigWeightBlockSize(spec.source, spec.config_json)) return *b;
  return BlockSize{};
}

}  // namespace

Agreement Handshake(Communicator& comm, const Plan& plan, const HandshakeRequest& rq) {
  FaultPoint("handshake", comm.rank());
  Agreement a;
  Problem local;
  std::vector<long long> keys;
  for (const auto& row : AllGather(comm, {LocalNodeKey()})) keys.push_back(row[0]);
  a.nodes = NodeMapFromKeys(keys);
  const bool coordinator = comm.rank() == 0;
  std::string blob;
  if (coordinator) {
    try {
      a.ckpt = OpenCheckpoint(rq);
      a.manifest =
          Resolve(plan, *a.ckpt, rq.mapping, StreamParamsFrom(rq.options), WeightBlock(rq.checkpoint, plan.spec()));
      blob = EncodeManifest(a.manifest);
    } catch (const std::exception& e) {
      local = AsProblem(e);
      blob.clear();
    }
  }
  int64_t size = static_cast<int64_t>(blob.size());
  comm.Broadcast(&size, sizeof(size), 0);
  if (!coordinator) blob.resize(static_cast<size_t>(size));
  comm.Broadcast(blob.data(), blob.size(), 0);
  if (local.message.empty() && size > 0) {
    try {
      if (!coordinator) a.manifest = DecodeManifest(blob);
      std::string diff = CheckManifest(a.manifest, plan, comm.rank(), comm.world_size());
      if (diff.empty()) diff = CheckParams(a.manifest.params, rq.options, comm.rank());
      if (!diff.empty()) local = Problem{ErrorKind::kManifestMismatch, diff};
      const auto route = Route::Make(a.manifest.params.source, a.manifest.world_size, a.nodes);
      if (local.message.empty() && route->Reads(comm.rank(), a.manifest.params.verify)) {
        if (!a.ckpt) a.ckpt = OpenCheckpoint(rq);
        diff = MatchFiles(a.manifest, *a.ckpt, rq.checkpoint, comm.rank(), &a.files);
        if (!diff.empty()) local = Problem{ErrorKind::kManifestMismatch, diff};
      }
      a.adopted = Adopted(a.manifest.params, rq.options);
    } catch (const std::exception& e) {
      local = AsProblem(e);
    }
  }
  Agree(comm, "handshake", local);
  return a;
}

void FailHandshake(Communicator& comm, ErrorKind kind, const std::string& problem) {
  AllGather(comm, {LocalNodeKey()});  // the handshake's collectives, in its order
  int64_t size = 0;
  comm.Broadcast(&size, sizeof(size), 0);  // rank 0's manifest size; ours carries nothing if we are rank 0
  std::string blob(static_cast<size_t>(comm.rank() == 0 ? 0 : size), '\0');
  comm.Broadcast(blob.data(), blob.size(), 0);
  Agree(comm, "handshake", Problem{kind, problem});
  throw Error(kind, "handshake", problem);  // not reached: Agree throws for a non-empty problem
}

}  // namespace shardcast
