#include "runtime/manifest/manifest.h"

#include <algorithm>
#include <deque>
#include <map>
#include <optional>
#include <set>
#include <unordered_map>
#include <unordered_set>

#include "allocators/error.h"
#include "loaders/shape.h"
#include "runtime/manifest/quant_parts.h"

namespace shardcast {
namespace {

bool FromCheckpoint(Role r) { return r != Role::kNonPersistentBuffer; }

// Of a composed key's parts (keys[i] found as parts[i]), the first whose shape is not the one most of them
// have, as "; '<key>' is [8, 3] in the checkpoint (<file>) where the other 127 are [8, 4]"; else, where all
// have one shape, that shape: the message then says what each part holds, and the model what it expects.
std::string OddPart(const std::vector<std::string>& keys, const std::vector<const Checkpoint::Entry*>& parts) {
  std::map<std::vector<uint64_t>, size_t> count;
  for (const Checkpoint::Entry* p : parts) ++count[p->info->shape];
  if (count.empty()) return "";
  const auto most = std::max_element(count.begin(), count.end(),
                                     [](const auto& a, const auto& b) { return a.second < b.second; });
  if (count.size() == 1) return "; each part is " + ShapeText(most->first);
  for (size_t i = 0; i < parts.size(); ++i) {
    if (parts[i]->info->shape == most->first) continue;
    return "; '" + keys[i] + "' is " + ShapeText(parts[i]->info->shape) + " in the checkpoint (" + parts[i]->file->path() +
           ") where " + std::to_string(most->second) + " of the " + std::to_string(parts.size()) + " parts are " +
           ShapeText(most->first);
  }
  return "";
}

// Rank 0's side of the resolution: one plan entry at a time, by key.
class Resolver {
 public:
  Resolver(Manifest* m, const Checkpoint& ckpt, const KeyMapping& mapping, BlockSize block)
      : m_(*m), ckpt_(ckpt), mapping_(mapping), block_(block), used_(ckpt.num_keys(), 0) {
    for (size_t i = 0; i < ckpt.num_files(); ++i) file_index_[&ckpt.file(i)] = static_cast<uint32_t>(i);
  }

  ManifestEntry Entry(const PlanEntry& e) {
    ManifestEntry me;
    me.key = m_.Keep(e.key);
    me.target_dtype = e.dtype;
    me.shape = m_.KeepShape(e.shape);
    me.role = e.role;
    me.layout = e.layout_index;
    if (auto c = mapping_.compose.find(e.key); c != mapping_.compose.end()) {
      uint64_t numel = 0;
      std::vector<const Checkpoint::Entry*> parts;
      for (const std::string& ck : c->second) {
        const Checkpoint::Entry* found = ckpt_.Find(ck);
        if (found == nullptr) throw Missing(e.key, ck);
        parts.push_back(found);
        me.parts.push_back(Part(e, me.key, ck, *found));
        KeepKeys(me.key, &me.parts.back());
        numel += me.parts.back().numel;  // the elements it supplies (an NVFP4 part: twice its bytes)
      }
      if (numel != Numel(e.shape)) {
        throw Error(ErrorKind::kManifestMismatch, "key '" + e.key + "'",
                    "its " + std::to_string(c->second.size()) + " checkpoint parts hold " + std::to_string(numel) +
                        " elements but rank 0's plan has " + ShapeText(e.shape) + " = " +
                        std::to_string(Numel(e.shape)) + OddPart(c->second, parts));
      }
      return me;
    }
    std::string ck = CheckpointKey(e.key);
    const Checkpoint::Entry* found = ckpt_.Find(ck);
    if (found == nullptr) {
      if (auto packed = ResolveMxfp4Part(&m_, ckpt_, file_index_, e.key, ck, e.shape, e.dtype)) {
        Use(packed->checkpoint_key);
        Use(packed->scale->key);
        me.parts.push_back(std::move(*packed));
        return me;
      }
      if (auto t = mapping_.tied.find(e.key); t != mapping_.tied.end()) {
        ck = CheckpointKey(t->second);
        found = ckpt_.Find(ck);
      }
    }
    if (found == nullptr) throw Missing(e.key, ck);
    if (found->info->dtype == DType::kU8 && IsFloatingPoint(e.dtype)) {
      if (auto packed = ResolveNvfp4(e, ck, *found)) {
        if (packed->shape != e.shape) {
          throw Error(ErrorKind::kManifestMismatch, "key '" + e.key + "'",
                      "NVFP4 '" + ck + "' " + ShapeText(found->info->shape) + " in the checkpoint (" + found->file->path() +
                          ") holds " + ShapeText(packed->shape) + " but rank 0's plan has " + ShapeText(e.shape));
        }
        me.parts.push_back(std::move(*packed));
        return me;
      }
    }
    if (found->info->shape != e.shape) {
      throw Error(ErrorKind::kManifestMismatch, "key '" + e.key + "'",
                  "shape " + ShapeText(found->info->shape) + " in the checkpoint (" + found->file->path() + ") but " +
                      ShapeText(e.shape) + " in rank 0's plan");
    }
    me.parts.push_back(Part(e, me.key, ck, *found));
    KeepKeys(me.key, &me.parts.back());
    return me;
  }

  // The key of a part from Part, which views a string of the resolver's or the checkpoint's, as one the
  // manifest owns: the entry's own when they are equal (a checkpoint that names tensors as the model
  // does). Parts that dequantize (quant_parts.h) come with their keys kept.
  void KeepKeys(std::string_view entry_key, ManifestPart* p) {
    if (p->dequantize) return;
    p->checkpoint_key = p->checkpoint_key == entry_key ? entry_key : m_.Keep(p->checkpoint_key);
  }

  // Whether the checkpoint's key_index-th key (Checkpoint::key) went into an entry.
  bool Used(size_t key_index) const { return used_[key_index] != 0; }

 private:
  std::string CheckpointKey(const std::string& key) const {
    if (!mapping_.strip_prefix.empty() && key.rfind(mapping_.strip_prefix, 0) == 0) {
      return key.substr(mapping_.strip_prefix.size());
    }
    return mapping_.add_prefix + key;
  }

  // The part checkpoint tensor `found` (key `ck`) gives entry `e` (its key kept as `entry_key`).
  ManifestPart Part(const PlanEntry& e, std::string_view entry_key, const std::string& ck,
                    const Checkpoint::Entry& found) {
    if (auto packed = ResolveNvfp4(e, ck, found)) return std::move(*packed);
    if (IsFp8(found.info->dtype) && kFp8Format.dequantizes_to(e.dtype)) return Dequantized(e, entry_key, ck, found);
    // E8M0 scales kept quantized ("scale_fmt": "ue8m0") may be stored as their exponent bytes (U8): the
    // same bytes, which transformers views as float8_e8m0fnu after loading.
    const DType stored = found.info->dtype == DType::kU8 && e.dtype == DType::kF8_E8M0 ? e.dtype : found.info->dtype;
    if (!CanConvert(stored, e.dtype)) {
      throw Error(ErrorKind::kManifestMismatch, "key '" + e.key + "'",
                  "dtype " + std::string(DTypeName(found.info->dtype)) + " of '" + ck + "' in the checkpoint (" +
                      found.file->path() + ") but " + std::string(DTypeName(e.dtype)) +
                      " in rank 0's plan, and there is no conversion between them");
    }
    used_[found.key_index] = 1;
    return PartAt(ck, stored, found);
  }

  // The part that is checkpoint tensor `found` (key `ck`, viewed until Entry keeps it), read as `source`.
  ManifestPart PartAt(const std::string& ck, DType source, const Checkpoint::Entry& found) {
    ManifestPart p;
    p.checkpoint_key = ck;
    p.source_dtype = source;
    p.file = file_index_.at(found.file);
    p.offset = found.file->header().data_offset() + found.info->begin;
    p.numel = found.info->numel();
    p.shape = m_.KeepShape(found.info->shape);
    return p;
  }

  // An fp8 weight for a floating entry: dequantized with its block scales, never cast without them; the
  // weight and its scale marked used.
  ManifestPart Dequantized(const PlanEntry& e, std::string_view entry_key, const std::string& ck,
                           const Checkpoint::Entry& found) {
    ManifestPart p = ResolveFp8Part(&m_, ckpt_, file_index_, e.key, entry_key, ck, block_, e.dtype);
    used_[found.key_index] = 1;
    for (const std::string& k : PackedConsumedKeys(p)) Use(k);
    return p;
  }

  // A U8 "<m>.weight" with NVFP4 scales beside it, for a floating entry; its partners marked used.
  std::optional<ManifestPart> ResolveNvfp4(const PlanEntry& e, const std::string& ck, const Checkpoint::Entry& found) {
    std::optional<ManifestPart> p = ResolveNvfp4Part(&m_, ckpt_, file_index_, e.key, ck, e.dtype);
    if (!p) return p;
    used_[found.key_index] = 1;
    for (const std::string& k : PackedConsumedKeys(*p)) Use(k);
    return p;
  }

  Error Missing(const std::string& key, const std::string& ck) const {
    return Error(ErrorKind::kManifestMismatch, "key '" + key + "'",
                 "rank 0's plan needs it but the checkpoint " + ckpt_.root() + " has no tensor '" + ck + "'");
  }

  Manifest& m_;
  const Checkpoint& ckpt_;
  const KeyMapping& mapping_;
  const BlockSize block_;
  void Use(std::string_view key) {
    if (const Checkpoint::Entry* e = ckpt_.Find(key)) used_[e->key_index] = 1;
  }

  FileIndex file_index_;
  std::vector<uint8_t> used_;  // by Checkpoint::Entry::key_index
};

}  // namespace

// What a manifest's keys and shapes view: the arena never frees or moves a string, nor the set a shape.
struct Manifest::Held {
  std::pmr::monotonic_buffer_resource strings;
  std::set<std::vector<uint64_t>> shapes;
  std::deque<ManifestScale> scales;
};

Manifest::Held& Manifest::held() {
  if (held_ == nullptr) held_ = std::make_shared<Held>();
  return *held_;
}

std::string_view Manifest::Keep(std::string_view text) {
  if (text.empty()) return {};
  char* copy = static_cast<char*>(held().strings.allocate(text.size(), 1));
  std::copy(text.begin(), text.end(), copy);
  return {copy, text.size()};
}

ShapeView Manifest::KeepShape(const std::vector<uint64_t>& shape) { return ShapeView(&*held().shapes.insert(shape).first); }

const ManifestScale* Manifest::KeepScale(ManifestScale scale) { return &held().scales.emplace_back(std::move(scale)); }

uint64_t ManifestPart::row_elems() const {
  if (shape.size() < 2) return 1;
  return shape[0] == 0 ? 0 : numel / shape[0];
}

StreamParams StreamParamsFrom(const LoadOptions& o) {
  StreamParams p;
  p.source = o.source;
  p.chunk_bytes = o.chunk_bytes;
  p.coalesce_bytes = std::min<uint64_t>(4ull << 20, o.chunk_bytes);
  p.staging_slots = static_cast<uint32_t>(o.staging_slots);
  p.verify = o.verify;
  p.strict_keys = o.strict_keys;
  return p;
}

uint64_t FileDigest(const SafetensorsFile& file) { return file.header_digest(); }

std::string RelativeName(const Checkpoint& ckpt, size_t i) {
  const std::string& path = ckpt.file(i).path();
  const std::string& root = ckpt.root();
  if (path == root) return path.substr(path.find_last_of('/') + 1);  // a single-file checkpoint
  if (path.compare(0, root.size(), root) == 0 && path.size() > root.size() && path[root.size()] == '/') {
    return path.substr(root.size() + 1);
  }
  return path;
}

Manifest Resolve(const Plan& plan, const Checkpoint& ckpt, const KeyMapping& mapping, const StreamParams& params,
                 BlockSize block) {
  Manifest m;
  m.world_size = plan.world_size();
  m.params = params;
  m.layouts = plan.layouts();
  for (size_t i = 0; i < ckpt.num_files(); ++i) {
    const SafetensorsFile& f = ckpt.file(i);
    m.files.push_back(ManifestFile{RelativeName(ckpt, i), f.file_size(), FileDigest(f), f.SampleDigest()});
  }
  Resolver resolver(&m, ckpt, mapping, block);
  m.entries.reserve(plan.entries().size());
  for (const PlanEntry& e : plan.entries()) {
    if (FromCheckpoint(e.role)) m.entries.push_back(resolver.Entry(e));
  }
  for (size_t i = 0; i < ckpt.num_keys(); ++i) {
    if (resolver.Used(i)) continue;
    ++m.skipped;
    if (m.skipped_examples.size() < 5) m.skipped_examples.emplace_back(ckpt.key(i));
  }
  if (params.strict_keys && m.skipped > 0) {
    throw Error(ErrorKind::kManifestMismatch, "checkpoint " + ckpt.root(),
                std::to_string(m.skipped) + " key(s) the model does not own, e.g. '" + m.skipped_examples.front() +
                    "' (extra keys are rejected; skip them to load anyway)");
  }
  return m;
}

std::string CheckManifest(const Manifest& m, const Plan& plan, int rank, int world_size) {
  const std::string me = "rank " + std::to_string(rank);
  if (m.world_size != plan.world_size() || m.world_size != world_size) {
    return "world size: rank 0 planned for " + std::to_string(m.world_size) + " ranks, " + me + " for " +
           std::to_string(plan.world_size()) + ", and the communicator has " + std::to_string(world_size);
  }
  size_t from_ckpt = 0;
  for (const PlanEntry& e : plan.entries()) from_ckpt += FromCheckpoint(e.role);
  size_t cursor = 0;
  for (const ManifestEntry& e : m.entries) {
    const PlanEntry* p = plan.FindNext(e.key, &cursor);
    if (p == nullptr) return "key '" + std::string(e.key) + "': in rank 0's plan but not in " + me + "'s";
    if (p->shape != e.shape) {
      return "key '" + std::string(e.key) + "': shape " + ShapeText(e.shape) + " on rank 0 but " + ShapeText(p->shape) +
             " on " + me;
    }
    if (p->dtype != e.target_dtype) {
      return "key '" + std::string(e.key) + "': dtype " + std::string(DTypeName(e.target_dtype)) + " on rank 0 but " +
             std::string(DTypeName(p->dtype)) + " on " + me;
    }
    if (p->role != e.role) {
      return "key '" + std::string(e.key) + "': role " + std::string(RoleName(e.role)) + " on rank 0 but " +
             std::string(RoleName(p->role)) + " on " + me;
    }
    if (!(*p->layout == m.LayoutOf(e))) {
      return "key '" + std::string(e.key) + "': layout " + m.LayoutOf(e).Text() + " on rank 0 but " +
             p->layout->Text() + " on " + me;
    }
  }
  if (from_ckpt != m.entries.size()) {
    std::unordered_set<std::string_view> in_manifest;
    for (const ManifestEntry& x : m.entries) in_manifest.insert(x.key);
    for (const PlanEntry& e : plan.entries()) {
      if (FromCheckpoint(e.role) && !in_manifest.count(e.key)) {
        return "key '" + std::string(e.key) + "': in " + me + "'s plan but not in rank 0's";
      }
    }
  }
  return {};
}

std::string Manifest::MeshText() const {
  std::vector<const Layout*> used(layouts.size(), nullptr);
  for (const ManifestEntry& e : entries) used[e.layout] = &layouts[e.layout];
  std::string out;
  for (const Layout* l : used) {
    if (l != nullptr && !l->boxes.empty() && out.find("explicit boxes") == std::string::npos) {
      out += (out.empty() ? "" : ", ") + std::string("explicit boxes");
    }
    if (l == nullptr || l->mesh_shape.empty()) continue;
    std::string text = "(";
    for (size_t i = 0; i < l->mesh_shape.size(); ++i) text += (i ? " x " : "") + std::to_string(l->mesh_shape[i]);
    text += ")";
    if (out.find(text) == std::string::npos) out += (out.empty() ? "" : ", ") + text;
  }
  return out.empty() ? "replicated" : (out[0] == '(' ? "mesh " + out : out);
}

uint64_t SourceBytes(const Manifest& m) {
  uint64_t total = 0;
  for (const ManifestEntry& e : m.entries) {
    for (const ManifestPart& p : e.parts) {
      total += p.dequantize ? PackedSourceBytes(p) : p.numel * DTypeSize(p.source_dtype);
    }
  }
  return total;
}

uint64_t DequantizedEntries(const Manifest& m) {
  uint64_t n = 0;
  for (const ManifestEntry& e : m.entries) {
    n += std::any_of(e.parts.begin(), e.parts.end(), [](const ManifestPart& p) { return p.dequantize; });
  }
  return n;
}

std::string CheckParams(const StreamParams& reader, const LoadOptions& mine, int rank) {
  std::string out;
  auto differ = [&](const char* name, bool theirs, bool ours) {
    if (theirs == ours) return;
    out += std::string(out.empty() ? "" : "; ") + name + " is " + (theirs ? "on" : "off") + " on rank 0 but " +
           (ours ? "on" : "off") + " on rank " + std::to_string(rank);
  };
  differ("verify", reader.verify, mine.verify);
  differ("strict_keys", reader.strict_keys, mine.strict_keys);
  if (!out.empty()) out += " (these change the result, so every rank must ask for the same)";
  return out;
}

}  // namespace shardcast
