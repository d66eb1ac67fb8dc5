// The manifest on the wire: little-endian, length-prefixed, versioned. One encoder, one decoder; a
// blob of another version or one cut short is a kComm error, never a misread.
//
//   "shardcast-manifest-8" | world | params | files[name, size, digest, sample]
//   | layouts[mesh shape, ranks, placements[kind, dim, split factor], boxes[offset, size]] | entries[...] | skipped
//   entry: key | dtype | role | layout index | shape | parts[key ("" = the entry's), dtype, file, offset,
//          numel, shape, dequantize, (scale key, dtype, file, offset, grid rows, cols, block rows, cols,
//          packing, NVFP4 global scale bits)]
#include <algorithm>
#include <cstring>

#include "allocators/error.h"
#include "runtime/manifest/manifest.h"

namespace shardcast {
namespace {

constexpr const char* kVersion = "shardcast-manifest-8";

class Writer {
 public:
  void U64(uint64_t v) { s_.append(reinterpret_cast<const char*>(&v), 8); }
  void Str(std::string_view v) {
    U64(v.size());
    s_ += v;
  }
  void Dims(const std::vector<uint64_t>& d) {
    U64(d.size());
    for (uint64_t x : d) U64(x);
  }
  // Room for `bytes` more without growing: a 17 MB manifest grown by doubling copied and faulted in
  // twice its size. An estimate past the end costs only address space.
  void Reserve(uint64_t bytes) { s_.reserve(s_.size() + bytes); }
  std::string Take() { return std::move(s_); }

 private:
  std::string s_;
};

class Reader {
 public:
  explicit Reader(const std::string& s) : s_(s) {}
  uint64_t U64() {
    Need(8);
    uint64_t v;
    std::memcpy(&v, s_.data() + p_, 8);
    p_ += 8;
    return v;
  }
  std::string Str() { return std::string(View()); }
  // The next string as a view of the blob (valid while the blob is).
  std::string_view View() {
    const uint64_t n = U64();
    Need(n);
    std::string_view v(s_.data() + p_, n);
    p_ += n;
    return v;
  }
  std::vector<uint64_t> Dims() {
    const uint64_t n = U64();
    Need(n, 8);
    std::vector<uint64_t> d(n);
    for (auto& x : d) x = U64();
    return d;
  }
  // A count of items that each take at least `each` bytes: bounded by what is left before reserving.
  uint64_t Count(uint64_t each) {
    const uint64_t n = U64();
    Need(n, each);
    return n;
  }
  template <typename E>
  E Enum(uint64_t limit) {
    const uint64_t v = U64();
    if (v >= limit) Fail("an out-of-range enum value " + std::to_string(v));
    return static_cast<E>(v);
  }
  bool Done() const { return p_ == s_.size(); }

 private:
  void Need(uint64_t n, uint64_t each = 1) {
    if (each != 0 && n > (s_.size() - p_) / each) Fail("a length past its end");
  }
  [[noreturn]] static void Fail(const std::string& what) {
    throw Error(ErrorKind::kComm, "manifest", "the manifest received from rank 0 is malformed: " + what);
  }
  const std::string& s_;
  size_t p_ = 0;
};

}  // namespace

std::string EncodeManifest(const Manifest& m) {
  Writer w;
  w.Str(kVersion);
  w.U64(static_cast<uint64_t>(m.world_size));
  const StreamParams& p = m.params;
  w.U64(static_cast<uint64_t>(p.source));
  w.Str(p.source_reason);
  w.U64(p.chunk_bytes);
  w.U64(p.coalesce_bytes);
  w.U64(p.staging_slots);
  w.U64(p.verify);
  w.U64(p.strict_keys);
  w.U64(m.files.size());
  for (const ManifestFile& f : m.files) {
    w.Str(f.name);
    w.U64(f.size);
    w.U64(f.digest);
    w.U64(f.sample);
  }
  w.U64(m.layouts.size());
  for (const Layout& l : m.layouts) {
    w.U64(l.mesh_shape.size());
    for (uint32_t d : l.mesh_shape) w.U64(d);
    w.U64(l.ranks.size());
    for (int r : l.ranks) w.U64(static_cast<uint64_t>(r));
    w.U64(l.placements.size());
    for (const Placement& p : l.placements) {
      w.U64(p.kind);
      w.U64(static_cast<uint64_t>(p.dim));
      w.U64(p.split_factor);
    }
    w.U64(l.boxes.size());
    for (const Box& b : l.boxes) {
      w.Dims(b.offset);
      w.Dims(b.size);
    }
  }
  uint64_t entry_bytes = 0;  // at least what the loop below writes: every field, a few words over
  for (const ManifestEntry& e : m.entries) {
    entry_bytes += 8 * 7 + e.key.size() + 8 * e.shape.size();
    for (const ManifestPart& part : e.parts) {
      const uint64_t scale_key = part.scale ? part.scale->key.size() : 0;
      entry_bytes += 8 * 19 + part.checkpoint_key.size() + scale_key + 8 * part.shape.size();
    }
  }
  w.Reserve(entry_bytes + 4096);
  w.U64(m.entries.size());
  for (const ManifestEntry& e : m.entries) {
    w.Str(e.key);
    w.U64(static_cast<uint64_t>(e.target_dtype));
    w.U64(static_cast<uint64_t>(e.role));
    w.U64(e.layout);
    w.Dims(e.shape);
    w.U64(e.parts.size());
    for (const ManifestPart& part : e.parts) {
      w.Str(part.checkpoint_key == e.key ? std::string_view() : part.checkpoint_key);
      w.U64(static_cast<uint64_t>(part.source_dtype));
      w.U64(part.file);
      w.U64(part.offset);
      w.U64(part.numel);
      w.Dims(part.shape);
      w.U64(part.dequantize);
      if (part.dequantize) {
        if (part.scale == nullptr) {
          throw Error(ErrorKind::kInternal, "key '" + std::string(e.key) + "'", "a part dequantizes without its scale");
        }
        const ManifestScale& sc = *part.scale;
        w.Str(sc.key);
        w.U64(static_cast<uint64_t>(sc.dtype));
        w.U64(sc.file);
        w.U64(sc.offset);
        w.U64(sc.grid_rows);
        w.U64(sc.grid_cols);
        w.U64(sc.block.rows);
        w.U64(sc.block.cols);
        w.U64(static_cast<uint64_t>(part.packing));
        w.U64(sc.global_bits);
      }
    }
  }
  w.U64(m.skipped);
  w.U64(m.skipped_examples.size());
  for (const auto& k : m.skipped_examples) w.Str(k);
  return w.Take();
}

Manifest DecodeManifest(const std::string& bytes) {
  Reader r(bytes);
  if (const std::string v = r.Str(); v != kVersion) {
    throw Error(ErrorKind::kComm, "manifest",
                "rank 0 sent a manifest of version \"" + v.substr(0, 40) + "\", this rank reads \"" + kVersion +
                    "\": every rank must run the same shardcast");
  }
  Manifest m;
  m.world_size = static_cast<int>(r.U64());
  if (m.world_size < 1 || m.world_size > (1 << 24)) throw Error(ErrorKind::kComm, "manifest", "a world size out of range");
  StreamParams& p = m.params;
  p.source = r.Enum<Source>(kNumSources);
  if (p.source == Source::kAuto) throw Error(ErrorKind::kComm, "manifest", "rank 0 sent an undecided source");
  p.source_reason = r.Str();
  p.chunk_bytes = r.U64();
  p.coalesce_bytes = r.U64();
  p.staging_slots = static_cast<uint32_t>(r.U64());
  p.verify = r.U64() != 0;
  p.strict_keys = r.U64() != 0;
  m.files.resize(r.Count(32));
  for (ManifestFile& f : m.files) {
    f.name = r.Str();
    f.size = r.U64();
    f.digest = r.U64();
    f.sample = r.U64();
  }
  m.layouts.resize(r.Count(24));
  for (Layout& l : m.layouts) {
    l.mesh_shape.resize(r.Count(8));
    for (uint32_t& d : l.mesh_shape) d = static_cast<uint32_t>(std::min<uint64_t>(r.U64(), 1u << 24));
    l.ranks.resize(r.Count(8));
    for (int& x : l.ranks) {
      x = static_cast<int>(r.U64());
      if (x < 0 || x >= m.world_size) throw Error(ErrorKind::kComm, "manifest", "a layout names a rank past the world");
    }
    l.placements.resize(r.Count(24));
    for (Placement& p : l.placements) {
      p.kind = r.Enum<Placement::Kind>(3);
      p.dim = static_cast<int>(std::min<uint64_t>(r.U64(), 64));
      p.split_factor = static_cast<uint32_t>(std::min<uint64_t>(r.U64(), 1u << 24));
    }
    l.boxes.resize(r.Count(16));
    for (Box& b : l.boxes) {
      b.offset = r.Dims();
      b.size = r.Dims();
    }
  }
  m.entries.resize(r.Count(48));
  for (ManifestEntry& e : m.entries) {
    e.key = m.Keep(r.View());
    e.target_dtype = r.Enum<DType>(kNumDTypes);
    e.role = r.Enum<Role>(4);
    e.layout = static_cast<uint32_t>(r.U64());
    if (e.layout >= m.layouts.size()) throw Error(ErrorKind::kComm, "manifest", "an entry names a layout past the list");
    e.shape = m.KeepShape(r.Dims());
    try {
      m.layouts[e.layout].CheckKey(e.shape, std::string(e.key));
    } catch (const Error& bad) {
      throw Error(ErrorKind::kComm, "manifest", std::string("the manifest received from rank 0 is malformed: ") + bad.what());
    }
    e.parts.resize(r.Count(48));
    for (ManifestPart& part : e.parts) {
      part.checkpoint_key = r.View();
      part.checkpoint_key = part.checkpoint_key.empty() ? e.key : m.Keep(part.checkpoint_key);
      part.source_dtype = r.Enum<DType>(kNumDTypes);
      part.file = static_cast<uint32_t>(r.U64());
      if (part.file >= m.files.size()) throw Error(ErrorKind::kComm, "manifest", "a part names a file past the list");
      part.offset = r.U64();
      part.numel = r.U64();
      part.shape = m.KeepShape(r.Dims());
      part.dequantize = r.U64() != 0;
      if (part.dequantize) {
        ManifestScale sc;
        sc.key = r.Str();
        sc.dtype = r.Enum<DType>(kNumDTypes);
        sc.file = static_cast<uint32_t>(r.U64());
        if (sc.file >= m.files.size()) throw Error(ErrorKind::kComm, "manifest", "a scale names a file past the list");
        sc.offset = r.U64();
        sc.grid_rows = r.U64();
        sc.grid_cols = r.U64();
        sc.block.rows = r.U64();
        sc.block.cols = r.U64();
        part.packing = r.Enum<Packing>(3);
        sc.global_bits = static_cast<uint32_t>(r.U64());
        part.scale = m.KeepScale(std::move(sc));
      }
    }
  }
  m.skipped = r.U64();
  m.skipped_examples.resize(r.Count(8));
  for (auto& k : m.skipped_examples) k = r.Str();
  if (!r.Done()) throw Error(ErrorKind::kComm, "manifest", "the manifest received from rank 0 has trailing bytes");
  return m;
}

}  // namespace shardcast
