// The save's layout, decided by rank 0: the output tensors by key (save_pretrained's names and
// per-expert split), their files under max_shard_size, each file's header, and the index.
#include "runtime/save_layout.h"

#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <filesystem>
#include <map>
#include <random>
#include <unordered_set>

#include "allocators/error.h"
#include "loaders/shape.h"
#include "loaders/writer.h"
#include "runtime/engine/file_sink.h"

namespace shardcast {
namespace {

std::string Absolute(const std::string& path) {
  if (path.empty()) throw Error(ErrorKind::kInvalidArgument, "out_dir", "'' is not a directory to save into");
  std::filesystem::path p = std::filesystem::absolute(path).lexically_normal();
  if (p.filename().empty()) p = p.parent_path();  // "dir/" -> "dir"
  // A symlink to the output directory (cluster storage often is one) is followed: the new tree is built
  // beside the directory it names and swapped with it, where renaming onto the link failed after every
  // byte was written.
  std::error_code ec;
  if (std::filesystem::is_symlink(p, ec)) {
    const std::filesystem::path target = std::filesystem::canonical(p, ec);
    if (!ec) return target.string();
  }
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
    ManifestEntry me{m->Keep(e.key), e.dtype, m->KeepShape(e.shape), e.role, e.layout_index, {}};
    const DType file_dtype = FileDType(e.dtype, rq.dtype);
    auto it = rq.outputs.find(e.key);
    const std::vector<SaveOutput> own{{e.key, e.shape}};
    uint64_t numel = 0;
    for (const SaveOutput& o : it == rq.outputs.end() ? own : it->second) {
      if (!seen.insert(o.key).second) {
        throw Error(ErrorKind::kInvalidArgument, "key '" + o.key + "'", "two model entries write this output tensor");
      }
      ManifestPart part;
      part.checkpoint_key = o.key == e.key ? me.key : m->Keep(o.key);
      part.source_dtype = file_dtype;
      part.numel = Numel(o.shape);
      part.shape = m->KeepShape(o.shape);
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

std::string FileName(size_t i, size_t n, bool numbered) {
  if (n == 1 && !numbered) return "model.safetensors";
  char buf[64];
  std::snprintf(buf, sizeof(buf), "model-%05zu-of-%05zu.safetensors", i + 1, n);
  return buf;
}

struct FileGroup {
  std::string name;
  std::vector<ManifestPart*> parts;
};

// Output tensors to files in model order, greedily up to max_shard_bytes (a larger tensor gets a file
// of its own), as transformers' split_torch_state_dict_into_shards does.
std::vector<FileGroup> BySize(const SaveRequest& rq, Manifest& m) {
  std::vector<std::vector<ManifestPart*>> files(1);
  uint64_t in_file = 0;
  for (ManifestEntry& e : m.entries) {
    for (ManifestPart& p : e.parts) {
      const uint64_t bytes = p.numel * DTypeSize(p.source_dtype);
      if (!files.back().empty() && (bytes > rq.max_shard_bytes || in_file + bytes > rq.max_shard_bytes)) {
        files.emplace_back();
        in_file = 0;
      }
      files.back().push_back(&p);
      in_file += bytes;
    }
  }
  std::vector<FileGroup> out;
  for (size_t f = 0; f < files.size(); ++f) {
    out.push_back(FileGroup{FileName(f, files.size(), rq.numbered_files), std::move(files[f])});
  }
  return out;
}

// Output tensors to the files their numbers name (SaveRequest::file_numbers), in model order within each:
//   {a: 2, b: 1, c: 2, z: 3}, outputs a b c  ->  model-00001-of-00003: b   model-00002-of-00003: a c
std::vector<FileGroup> ByNumber(const SaveRequest& rq, Manifest& m) {
  uint32_t n = 0;
  for (const auto& [key, number] : rq.file_numbers) {
    if (number == 0) throw Error(ErrorKind::kInvalidArgument, "key '" + key + "'", "file number 0 (they start at 1)");
    n = std::max(n, number);
  }
  std::map<uint32_t, std::vector<ManifestPart*>> files;
  for (ManifestEntry& e : m.entries) {
    for (ManifestPart& p : e.parts) {
      auto it = rq.file_numbers.find(std::string(p.checkpoint_key));
      if (it == rq.file_numbers.end()) {
        throw Error(ErrorKind::kInvalidArgument, "key '" + std::string(p.checkpoint_key) + "'",
                    "has no file number (fqn_to_index_mapping names " + std::to_string(rq.file_numbers.size()) +
                        " tensors, not this one)");
      }
      files[it->second].push_back(&p);
    }
  }
  std::vector<FileGroup> out;
  for (auto& [number, parts] : files) {
    char buf[64];
    std::snprintf(buf, sizeof(buf), "model-%05u-of-%05u.safetensors", number, n);
    out.push_back(FileGroup{buf, std::move(parts)});
  }
  return out;
}

// The files (by size or by number); within a file, wider dtypes first so that every tensor stays
// aligned; headers, absolute offsets, and the index.
void Files(const SaveRequest& rq, Agreed* a) {
  Manifest& m = a->manifest;
  uint64_t total = 0, parameters = 0;
  for (ManifestEntry& e : m.entries) {
    if (e.role == Role::kParameter) parameters += Numel(e.shape);
    for (ManifestPart& p : e.parts) total += p.numel * DTypeSize(p.source_dtype);
  }
  std::vector<FileGroup> files = rq.file_numbers.empty() ? BySize(rq, m) : ByNumber(rq, m);
  nlohmann::json weight_map = nlohmann::json::object();
  for (size_t f = 0; f < files.size(); ++f) {
    auto& parts = files[f].parts;
    std::stable_sort(parts.begin(), parts.end(), [](const ManifestPart* x, const ManifestPart* y) {
      return DTypeSize(x->source_dtype) > DTypeSize(y->source_dtype);
    });
    std::vector<WriteEntry> entries;
    for (const ManifestPart* p : parts) {
      entries.push_back(WriteEntry{std::string(p->checkpoint_key), p->source_dtype, p->shape});
    }
    std::string header = BuildHeader(entries, {{"format", "pt"}});
    uint64_t offset = header.size();
    const std::string& name = files[f].name;
    for (ManifestPart* p : parts) {
      p->file = static_cast<uint32_t>(f);
      p->offset = offset;
      offset += p->numel * DTypeSize(p->source_dtype);
      weight_map[std::string(p->checkpoint_key)] = name;
    }
    m.files.push_back(ManifestFile{name, offset, XXH3_64bits(header.data(), header.size())});
    a->headers.push_back(std::move(header));
  }
  if (files.size() > 1 || rq.numbered_files || !rq.file_numbers.empty()) {
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
          {"max_shard_bytes", rq.max_shard_bytes}, {"keep_other_files", rq.keep_other_files},
          {"numbered_files", rq.numbered_files}};
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
