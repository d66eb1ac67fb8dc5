#include "runtime/manifest.h"

#include <cstring>
#include <set>

#include "allocators/error.h"

namespace shardcast {
namespace {

std::string Shape(const std::vector<uint64_t>& s) {
  std::string out = "[";
  for (size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
  return out + "]";
}

bool FromCheckpoint(Role r) { return r != Role::kNonPersistentBuffer; }

// Little-endian, length-prefixed: small and fast for ~100k entries.
class Out {
 public:
  void U64(uint64_t v) { s_.append(reinterpret_cast<const char*>(&v), 8); }
  void Str(const std::string& v) {
    U64(v.size());
    s_ += v;
  }
  std::string s_;
};

class In {
 public:
  explicit In(const std::string& s) : s_(s) {}
  uint64_t U64() {
    Need(8);
    uint64_t v;
    std::memcpy(&v, s_.data() + p_, 8);
    p_ += 8;
    return v;
  }
  std::string Str() {
    uint64_t n = U64();
    Need(n);
    std::string v = s_.substr(p_, n);
    p_ += n;
    return v;
  }
  void Need(uint64_t n) {
    if (n > s_.size() - p_) throw Error(ErrorKind::kComm, "manifest", "truncated or malformed manifest received");
  }

 private:
  const std::string& s_;
  size_t p_ = 0;
};

}  // namespace

std::string Manifest::Serialize() const {
  Out o;
  o.Str("shardcast-manifest-1");
  o.U64(static_cast<uint64_t>(world_size));
  o.U64(files.size());
  for (const auto& f : files) o.Str(f);
  o.U64(entries.size());
  for (const auto& e : entries) {
    o.Str(e.key);
    o.U64(static_cast<uint64_t>(e.target_dtype) | static_cast<uint64_t>(e.role) << 8 |
          static_cast<uint64_t>(e.placement) << 16);
    o.U64(e.shape.size());
    for (uint64_t d : e.shape) o.U64(d);
    o.U64(e.parts.size());
    for (const auto& p : e.parts) {
      o.Str(p.checkpoint_key == e.key ? std::string() : p.checkpoint_key);
      o.U64(static_cast<uint64_t>(p.source_dtype));
      o.U64(p.file);
      o.U64(p.offset);
      o.U64(p.numel);
    }
  }
  o.U64(skipped);
  o.U64(skipped_examples.size());
  for (const auto& k : skipped_examples) o.Str(k);
  return o.s_;
}

Manifest Manifest::Deserialize(const std::string& bytes) {
  In in(bytes);
  if (in.Str() != "shardcast-manifest-1") throw Error(ErrorKind::kComm, "manifest", "unknown manifest version");
  Manifest m;
  m.world_size = static_cast<int>(in.U64());
  m.files.resize(in.U64());
  for (auto& f : m.files) f = in.Str();
  uint64_t n = in.U64();
  in.Need(n);  // every entry takes more than a byte: a bound before reserving
  m.entries.resize(n);
  for (auto& e : m.entries) {
    e.key = in.Str();
    uint64_t packed = in.U64();
    e.target_dtype = static_cast<DType>(packed & 0xff);
    e.role = static_cast<Role>((packed >> 8) & 0xff);
    e.placement = static_cast<Placement::Kind>((packed >> 16) & 0xff);
    uint64_t dims = in.U64();
    in.Need(dims * 8);
    e.shape.resize(dims);
    for (auto& d : e.shape) d = in.U64();
    uint64_t parts = in.U64();
    in.Need(parts * 40);
    e.parts.resize(parts);
    for (auto& p : e.parts) {
      p.checkpoint_key = in.Str();
      if (p.checkpoint_key.empty()) p.checkpoint_key = e.key;
      p.source_dtype = static_cast<DType>(in.U64());
      p.file = static_cast<uint32_t>(in.U64());
      p.offset = in.U64();
      p.numel = in.U64();
    }
  }
  m.skipped = in.U64();
  m.skipped_examples.resize(std::min<uint64_t>(in.U64(), 5));
  for (auto& k : m.skipped_examples) k = in.Str();
  return m;
}

Manifest Resolve(const Plan& plan, const Checkpoint& ckpt, const KeyMapping& mapping, ExtraKeys extra) {
  Manifest m;
  m.world_size = plan.world_size();
  std::map<const SafetensorsFile*, uint32_t> file_index;
  for (size_t i = 0; i < ckpt.num_files(); ++i) {
    file_index[&ckpt.file(i)] = static_cast<uint32_t>(i);
    m.files.push_back(ckpt.file(i).path());
  }
  auto checkpoint_key = [&](const std::string& key) {
    if (!mapping.strip_prefix.empty() && key.rfind(mapping.strip_prefix, 0) == 0) {
      return key.substr(mapping.strip_prefix.size());
    }
    return mapping.add_prefix + key;
  };
  std::set<std::string> used;
  auto part_of = [&](const Checkpoint::Entry& found, const std::string& ck) {
    return ManifestPart{ck, found.info->dtype, file_index.at(found.file),
                        found.file->header().data_offset() + found.info->begin, found.info->numel()};
  };
  auto check_dtype = [&](const std::string& key, const std::string& ck, const Checkpoint::Entry& found, DType want) {
    if (!CanConvert(found.info->dtype, want)) {
      throw Error(ErrorKind::kManifestMismatch, "key '" + key + "'",
                  "dtype " + std::string(DTypeName(found.info->dtype)) + " of '" + ck + "' in the checkpoint (" +
                      found.file->path() + ") but " + std::string(DTypeName(want)) +
                      " in rank 0's plan, and there is no conversion between them");
    }
  };
  auto missing = [&](const std::string& key, const std::string& ck) {
    return Error(ErrorKind::kManifestMismatch, "key '" + key + "'",
                 "rank 0's plan needs it but the checkpoint " + ckpt.root() + " has no tensor '" + ck + "'");
  };
  for (const PlanEntry& e : plan.entries()) {
    if (!FromCheckpoint(e.role)) continue;
    ManifestEntry me;
    me.key = e.key;
    me.target_dtype = e.dtype;
    me.shape = e.shape;
    me.role = e.role;
    me.placement = e.placement.kind;
    if (auto c = mapping.compose.find(e.key); c != mapping.compose.end()) {
      uint64_t numel = 0;
      for (const std::string& ck : c->second) {
        const Checkpoint::Entry* found = ckpt.Find(ck);
        if (found == nullptr) throw missing(e.key, ck);
        check_dtype(e.key, ck, *found, e.dtype);
        me.parts.push_back(part_of(*found, ck));
        numel += found->info->numel();
        used.insert(ck);
      }
      uint64_t want = 1;
      for (uint64_t d : e.shape) want *= d;
      if (numel != want) {
        throw Error(ErrorKind::kManifestMismatch, "key '" + e.key + "'",
                    "its " + std::to_string(c->second.size()) + " checkpoint parts hold " + std::to_string(numel) +
                        " elements but rank 0's plan has " + Shape(e.shape) + " = " + std::to_string(want));
      }
      m.entries.push_back(std::move(me));
      continue;
    }
    std::string ck = checkpoint_key(e.key);
    const Checkpoint::Entry* found = ckpt.Find(ck);
    if (found == nullptr) {
      if (auto t = mapping.tied.find(e.key); t != mapping.tied.end()) {
        ck = checkpoint_key(t->second);
        found = ckpt.Find(ck);
      }
    }
    if (found == nullptr) throw missing(e.key, ck);
    used.insert(ck);
    const TensorInfo& t = *found->info;
    if (t.shape != e.shape) {
      throw Error(ErrorKind::kManifestMismatch, "key '" + e.key + "'",
                  "shape " + Shape(t.shape) + " in the checkpoint (" + found->file->path() + ") but " + Shape(e.shape) +
                      " in rank 0's plan");
    }
    check_dtype(e.key, ck, *found, e.dtype);
    me.parts.push_back(part_of(*found, ck));
    m.entries.push_back(std::move(me));
  }
  for (const auto& key : ckpt.keys()) {
    if (used.count(key)) continue;
    ++m.skipped;
    if (m.skipped_examples.size() < 5) m.skipped_examples.push_back(key);
  }
  if (extra == ExtraKeys::kError && m.skipped > 0) {
    throw Error(ErrorKind::kManifestMismatch, "checkpoint " + ckpt.root(),
                std::to_string(m.skipped) + " key(s) the model does not own, e.g. '" + m.skipped_examples.front() +
                    "' (extra keys are rejected; skip them to load anyway)");
  }
  return m;
}

std::string CheckManifest(const Manifest& m, const Plan& plan, int rank, int world_size) {
  const std::string me = "rank " + std::to_string(rank);
  if (m.world_size != world_size || plan.world_size() != world_size) {
    return "world size: rank 0 planned for " + std::to_string(m.world_size) + ", " + me + " for " +
           std::to_string(plan.world_size()) + ", and the communicator has " + std::to_string(world_size);
  }
  size_t from_ckpt = 0;
  for (const PlanEntry& e : plan.entries()) from_ckpt += FromCheckpoint(e.role);
  for (const ManifestEntry& e : m.entries) {
    const PlanEntry* p = plan.Find(e.key);
    if (p == nullptr) return "key '" + e.key + "': in rank 0's plan but not in " + me + "'s";
    if (p->shape != e.shape) {
      return "key '" + e.key + "': shape " + Shape(e.shape) + " on rank 0 but " + Shape(p->shape) + " on " + me;
    }
    if (p->dtype != e.target_dtype) {
      return "key '" + e.key + "': dtype " + std::string(DTypeName(e.target_dtype)) + " on rank 0 but " +
             std::string(DTypeName(p->dtype)) + " on " + me;
    }
    if (p->role != e.role || p->placement.kind != e.placement) {
      return "key '" + e.key + "': role/placement " + std::string(RoleName(e.role)) + " on rank 0 but " +
             std::string(RoleName(p->role)) + " on " + me;
    }
  }
  if (from_ckpt != m.entries.size()) {
    std::set<std::string_view> in_manifest;
    for (const ManifestEntry& x : m.entries) in_manifest.insert(x.key);
    for (const PlanEntry& e : plan.entries()) {
      if (FromCheckpoint(e.role) && !in_manifest.count(e.key)) {
        return "key '" + e.key + "': in " + me + "'s plan but not in rank 0's";
      }
    }
  }
  return {};
}

}  // namespace shardcast
