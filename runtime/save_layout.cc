// The save's layout, decided by rank 0: the output tensors by key (save_pretrained's names and
// per-expert split), their files under max_shard_size, each file's header, and the index.
#include "runtime/save_layout.h"

#include <unistd.h>
#include <xxhash.h>

#include <filesystem>
#include <random>
#include <unordered_set>

#include "allocators/error.h"
#include "loaders/writer.h"
#include "runtime/file_sink.h"

namespace shardcast {
namespace {

uint64_t Numel(const std::vector<uint64_t>& s) {
  uint64_t n = 1;
  for (uint64_t d : s) n *= d;
  return n;
}

std::string Absolute(const std::string& path) {
  std::filesystem::path p = std::filesystem::absolute(path).lexically_normal();
  if (p.filename().empty()) p = p.parent_path();  // "dir/" -> "dir"
  return p.string();
}

DType FileDType(DType held, const std::optional<DType>& asked) {
  const bool floating = held == DType::kF16 || held == DType::kBF16 || held == DType::kF32;
  return asked && floating ? *asked : held;
}

// The manifest's entries, with their parts (the output tensors) in order but not yet in files.
void Entries(const Plan& plan, const SaveRequest& rq, Manifest* m) {
  std::unordered_set<std::string> seen;
  for (const PlanEntry& e : plan.entries()) {
    if (e.role == Role::kNonPersistentBuffer) continue;
    ManifestEntry me{e.key, e.dtype, e.shape, e.role, e.layout_index, {}};
    const DType file_dtype = FileDType(e.dtype, rq.dtype);
    auto it = rq.outputs.find(e.key);
    const std::vector<SaveOutput> own{{e.key, e.shape}};
    uint64_t numel = 0;
    for (const SaveOutput& o : it == rq.outputs.end() ? own : it->second) {
      if (!seen.insert(o.key).second) {
        throw Error(ErrorKind::kInvalidArgument, "key '" + o.key + "'", "two model entries write this output tensor");
      }
      ManifestPart part;
      part.checkpoint_key = o.key;
      part.source_dtype = file_dtype;
      part.numel = Numel(o.shape);
      part.shape = o.shape;
      me.parts.push_back(std::move(part));
      numel += Numel(o.shape);
    }
    if (numel != Numel(e.shape)) {
      throw Error(ErrorKind::kInvalidArgument, "key '" + e.key + "'",
                  "its output tensors hold " + std::to_string(numel) + " elements but the entry has " +
                      std::to_string(Numel(e.shape)));
    }
    m->entries.push_back(std::move(me));
  }
}

std::string FileName(size_t i, size_t n) {
  if (n == 1) return "model.safetensors";
  char buf[64];
  std::snprintf(buf, sizeof(buf), "model-%05zu-of-%05zu.safetensors", i + 1, n);
  return buf;
}

// Output tensors to files in model order, greedily up to max_shard_bytes (a larger tensor gets a file
// of its own), as transformers' split_torch_state_dict_into_shards does; within a file, wider dtypes
// first so that every tensor stays aligned; headers, absolute offsets, and the index.
void Files(const SaveRequest& rq, Agreed* a) {
  Manifest& m = a->manifest;
  std::vector<std::vector<ManifestPart*>> files(1);
  uint64_t in_file = 0, total = 0, parameters = 0;
  for (ManifestEntry& e : m.entries) {
    if (e.role == Role::kParameter) parameters += Numel(e.shape);
    for (ManifestPart& p : e.parts) {
      const uint64_t bytes = p.numel * DTypeSize(p.source_dtype);
      if (!files.back().empty() && (bytes > rq.max_shard_bytes || in_file + bytes > rq.max_shard_bytes)) {
        files.emplace_back();
        in_file = 0;
      }
      files.back().push_back(&p);
      in_file += bytes;
      total += bytes;
    }
  }
  nlohmann::json weight_map = nlohmann::json::object();
  for (size_t f = 0; f < files.size(); ++f) {
    auto& parts = files[f];
    std::stable_sort(parts.begin(), parts.end(), [](const ManifestPart* x, const ManifestPart* y) {
      return DTypeSize(x->source_dtype) > DTypeSize(y->source_dtype);
    });
    std::vector<WriteEntry> entries;
    for (const ManifestPart* p : parts) entries.push_back(WriteEntry{p->checkpoint_key, p->source_dtype, p->shape});
    std::string header = BuildHeader(entries, {{"format", "pt"}});
    uint64_t offset = header.size();
    const std::string name = FileName(f, files.size());
    for (ManifestPart* p : parts) {
      p->file = static_cast<uint32_t>(f);
      p->offset = offset;
      offset += p->numel * DTypeSize(p->source_dtype);
      weight_map[p->checkpoint_key] = name;
    }
    m.files.push_back(ManifestFile{name, offset, XXH3_64bits(header.data(), header.size())});
    a->headers.push_back(std::move(header));
  }
  if (files.size() > 1) {
    nlohmann::json index = {{"metadata", {{"total_parameters", parameters}, {"total_size", total}}},
                            {"weight_map", weight_map}};
    a->index = index.dump(2) + "\n";
  }
}

// Rank 0's checks of the directory, and the layout.
}  // namespace

// What every rank must ask for the same (rank 0's governs the layout; a difference is an error).
nlohmann::json Params(const SaveRequest& rq) {
  return {{"out_dir", Absolute(rq.out_dir)}, {"mode", SourceName(rq.options.source)},
          {"dtype", rq.dtype ? std::string(DTypeName(*rq.dtype)) : "as held"}, {"overwrite", rq.overwrite},
          {"max_shard_bytes", rq.max_shard_bytes}};
}


Agreed Decide(const Plan& plan, const SaveRequest& rq, int world) {
  Agreed a;
  a.out_dir = Absolute(rq.out_dir);
  if (a.out_dir == "/" || rq.out_dir.empty()) {
    throw Error(ErrorKind::kInvalidArgument, "out_dir", "'" + rq.out_dir + "' is not a directory to save into");
  }
  a.leftovers = output_dir::Check(a.out_dir, rq.overwrite);
  std::random_device rd;
  char id[40];
  std::snprintf(id, sizeof(id), "%d-%08x", static_cast<int>(::getpid()), rd());
  a.tmp_dir = a.out_dir + ".tmp-" + id;
  a.manifest.world_size = world;
  a.manifest.layouts = plan.layouts();
  a.manifest.params = StreamParamsFrom(rq.options);
  a.manifest.params.verify = a.manifest.params.strict_keys = false;
  if (a.manifest.params.source == Source::kAuto) {  // every rank writes its own rows: the save's default
    a.manifest.params.source = Source::kEachRank;
    a.manifest.params.source_reason = "auto: every rank writes its own rows";
  }
  Entries(plan, rq, &a.manifest);
  Files(rq, &a);
  return a;
}

std::string CheckParams(const nlohmann::json& theirs, const SaveRequest& rq, int rank) {
  const nlohmann::json mine = Params(rq);
  for (const auto& [k, v] : theirs.items()) {
    if (mine.contains(k) && mine[k] != v) {
      return k + " is " + v.dump() + " on rank 0 but " + mine[k].dump() + " on rank " + std::to_string(rank) +
             " (every rank must ask for the same save)";
    }
  }
  return {};
}

}  // namespace shardcast
