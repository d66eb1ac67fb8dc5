#include "loaders/synth.h"

#include <xxhash.h>

#include <algorithm>
#include <cstring>
#include <nlohmann/json.hpp>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "allocators/error.h"
#include "loaders/quant/format.h"
#include "loaders/quant/nvfp4.h"

namespace shardcast {
namespace {

inline uint64_t Mix(uint64_t x) {  // splitmix64's finalizer
  x ^= x >> 30;
  x *= 0xBF58476D1CE4E5B9ull;
  x ^= x >> 27;
  x *= 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// A float of the given layout with |x| in [2^(lo - bias), 2^(lo + 7 - bias)): sign and mantissa
// from the hash, exponent field in [lo, lo + span).
template <typename T>
inline T FloatBits(uint64_t h, int mant_bits, int exp_bits, uint64_t lo, uint64_t span) {
  uint64_t sign = h >> 63;
  uint64_t exp = lo + ((h >> 40) % span);
  uint64_t mant = h & ((uint64_t{1} << mant_bits) - 1);
  return static_cast<T>((sign << (mant_bits + exp_bits)) | (exp << mant_bits) | mant);
}

template <typename T>
void Store(unsigned char* out, uint64_t i, T v) {
  std::memcpy(out + i * sizeof(T), &v, sizeof(T));
}


constexpr std::string_view kScaleSuffix = "_scale_inv";

bool EndsWith(std::string_view key, std::string_view suffix) {
  return key.size() >= suffix.size() && key.substr(key.size() - suffix.size()) == suffix;
}

// fp8's "_scale_inv" and NVFP4's per-tensor F32 scales: log-uniform positive values (StoreScale).
bool IsScaleKey(std::string_view key) {
  return EndsWith(key, kScaleSuffix) || EndsWith(key, ".weight_scale_2") || EndsWith(key, ".input_scale");
}

// NVFP4's "<m>.weight_scale" F8_E4M3 block scales: positive, every code from the smallest subnormal
// (0x01, 2^-9) to 448 (0x7E) uniformly, never 0 or NaN (ModelOpt clamps them to [2^-9, 448]).
bool IsNvfp4BlockScaleKey(std::string_view key, DType dtype) {
  return dtype == DType::kF8_E4M3 && EndsWith(key, ".weight_scale");
}

// A bell-shaped integer: four uniform 16-bit draws summed and centred, in [-131070, 131070].
inline int32_t BellInt(uint64_t h) {
  return static_cast<int32_t>(h & 0xFFFF) + static_cast<int32_t>((h >> 16) & 0xFFFF) +
         static_cast<int32_t>((h >> 32) & 0xFFFF) + static_cast<int32_t>(h >> 48) - 131070;
}

// v rounded to nearest even into an fp8 with `mant` mantissa bits and exponent bias `bias`.
// REQUIRES: v is zero or a normal float no larger in magnitude than the format's largest finite value.
inline uint8_t RoundToFp8(float v, int mant, int bias) {
  uint32_t u;
  std::memcpy(&u, &v, 4);
  const uint32_t sign = (u >> 24) & 0x80u, a = u & 0x7FFFFFFFu;
  if (a < 0x00800000u) return static_cast<uint8_t>(sign);
  const int e = static_cast<int>(a >> 23) - 127, emin = 1 - bias;
  const int shift = 23 - mant + (e < emin ? emin - e : 0);  // keeps mant bits, fewer for subnormals
  if (shift > 24) return static_cast<uint8_t>(sign);
  const uint32_t m = (a & 0x7FFFFFu) | 0x800000u;
  const uint32_t rem = m & ((1u << shift) - 1), half = 1u << (shift - 1);
  uint32_t q = m >> shift;
  q += rem > half || (rem == half && (q & 1u));
  // q carries the implicit bit at position mant, so adding it to (exponent - 1) << mant encodes the
  // value, a carry out of the mantissa included; subnormals are q itself.
  const uint32_t code = e < emin ? q : (static_cast<uint32_t>(e + bias - 1) << mant) + q;
  return static_cast<uint8_t>(sign | code);
}

// Quantized weights: the bell draw scaled so its extremes are the format's largest finite value.
// Never NaN or inf (448 is E4M3's 0x7E, 57344 E5M2's 0x7B; the clamps only guard the rounding).
uint8_t QuantizedE4M3Magnitude(int32_t z) {
  const uint8_t b = RoundToFp8(static_cast<float>(z) * (448.0f / 131070.0f), 3, 7);
  return b == 0x7F ? 0x7E : b;
}
uint8_t QuantizedE5M2Magnitude(int32_t z) {
  const uint8_t b = RoundToFp8(static_cast<float>(z) * (57344.0f / 131070.0f), 2, 15);
  return b >= 0x7C ? 0x7B : b;
}

// The code of every draw magnitude |z| <= 131070, computed once, so that a draw is one lookup (the
// rounding is symmetric: -z is z's code with the sign bit).
struct QuantizedTables {
  std::vector<uint8_t> e4m3, e5m2;
};
const QuantizedTables& Quantized() {
  static const QuantizedTables tables = [] {
    QuantizedTables t;
    t.e4m3.resize(131071);
    t.e5m2.resize(131071);
    for (int32_t z = 0; z <= 131070; ++z) {
      t.e4m3[z] = QuantizedE4M3Magnitude(z);
      t.e5m2[z] = QuantizedE5M2Magnitude(z);
    }
    return t;
  }();
  return tables;
}

inline uint8_t QuantizedFp8(const uint8_t* table, uint64_t h) {
  const int32_t z = BellInt(h);
  return z < 0 ? static_cast<uint8_t>(table[-z] | 0x80) : table[z];
}

// Scales: positive, exponent uniform over the 8 binades of [2^-14, 2^-6), mantissa uniform.
inline int ScaleExponent(uint64_t h) { return -14 + static_cast<int>((h >> 40) % 8); }

// Writes element i of a scale tensor; false for dtypes that have no scale values (integers, F64, ...).
inline bool StoreScale(DType dtype, uint64_t h, unsigned char* out, uint64_t i) {
  const uint32_t e = static_cast<uint32_t>(ScaleExponent(h));
  switch (dtype) {
    case DType::kF32: Store(out, i, static_cast<uint32_t>(((127 + e) << 23) | (h & 0x7FFFFF))); return true;
    case DType::kBF16: Store(out, i, static_cast<uint16_t>(((127 + e) << 7) | (h & 0x7F))); return true;
    case DType::kF16: Store(out, i, static_cast<uint16_t>(((15 + e) << 10) | (h & 0x3FF))); return true;
    case DType::kF8_E8M0: out[i] = static_cast<unsigned char>(127 + e); return true;
    default: return false;
  }
}

BlockSize ConfigBlockSize(const ModelSpec& spec) {
  return ConfigWeightBlockSize(spec.source, spec.config_json).value_or(BlockSize{});
}

std::string ConfigWithoutQuantization(const std::string& config_json) {
  nlohmann::json j = nlohmann::json::parse(config_json, nullptr, /*allow_exceptions=*/false);
  if (!j.is_object()) return config_json;
  j.erase("quantization_config");
  return j.dump(2);
}

}  // namespace

uint64_t SynthTensorSeed(uint64_t seed, std::string_view key) {
  return XXH3_64bits_withSeed(key.data(), key.size(), seed);
}

void SynthElements(uint64_t seed, std::string_view key, DType dtype, uint64_t first, uint64_t n, void* dst) {
  const uint64_t base = SynthTensorSeed(seed, key);
  const bool scale = IsScaleKey(key), nvfp4_scale = IsNvfp4BlockScaleKey(key, dtype);
  const uint8_t* e4m3 = dtype == DType::kF8_E4M3 ? Quantized().e4m3.data() : nullptr;
  const uint8_t* e5m2 = dtype == DType::kF8_E5M2 ? Quantized().e5m2.data() : nullptr;
  auto* out = static_cast<unsigned char*>(dst);
  for (uint64_t i = 0; i < n; ++i) {
    const uint64_t h = Mix(base + (first + i) * 0x9E3779B97F4A7C15ull);
    if (scale && StoreScale(dtype, h, out, i)) continue;
    if (nvfp4_scale) {
      out[i] = static_cast<unsigned char>(1 + (h >> 40) % 0x7E);
      continue;
    }
    switch (dtype) {
      case DType::kBool: out[i] = h & 1; break;
      case DType::kU8: case DType::kI8: out[i] = static_cast<unsigned char>(h); break;
      case DType::kU16: case DType::kI16: Store(out, i, static_cast<uint16_t>(h)); break;
      case DType::kU32: case DType::kI32: Store(out, i, static_cast<uint32_t>(h)); break;
      case DType::kU64: case DType::kI64: Store(out, i, h); break;
      case DType::kF16: Store(out, i, FloatBits<uint16_t>(h, 10, 5, 8, 7)); break;
      case DType::kBF16: Store(out, i, FloatBits<uint16_t>(h, 7, 8, 120, 7)); break;
      case DType::kF32: Store(out, i, FloatBits<uint32_t>(h, 23, 8, 120, 7)); break;
      case DType::kF64: Store(out, i, FloatBits<uint64_t>(h, 52, 11, 1016, 7)); break;
      case DType::kF8_E4M3: out[i] = QuantizedFp8(e4m3, h); break;
      case DType::kF8_E5M2: out[i] = QuantizedFp8(e5m2, h); break;
      case DType::kF8_E8M0: out[i] = static_cast<unsigned char>(120 + (h >> 40) % 8); break;
      case DType::kC64:
        Store(out, 2 * i, FloatBits<uint32_t>(h, 23, 8, 120, 7));
        Store(out, 2 * i + 1, FloatBits<uint32_t>(Mix(h), 23, 8, 120, 7));
        break;
    }
  }
}

namespace {

// SynthDequantizedElements of an NVFP4 weight: the rows that cover [first, first + n), dequantized
// whole from their synthetic packed bytes, block scales and global scale.
void SynthNvfp4Elements(uint64_t seed, const SynthQuantizedWeight& q, DType target, uint64_t first, uint64_t n,
                        void* out) {
  const std::vector<std::string> partners = kNvfp4Format.consumed(q.key);  // block, global, input scale
  const uint64_t cols = q.shape[1], r0 = first / cols, r1 = (first + n + cols - 1) / cols;
  const size_t ts = DTypeSize(target);
  std::vector<unsigned char> v((r1 - r0) * cols / 2), s((r1 - r0) * cols / kNvfp4Block), rows((r1 - r0) * cols * ts);
  float global;
  SynthElements(seed, q.key, DType::kU8, r0 * cols / 2, v.size(), v.data());
  SynthElements(seed, partners[0], DType::kF8_E4M3, r0 * cols / kNvfp4Block, s.size(), s.data());
  SynthElements(seed, partners[1], DType::kF32, 0, 1, &global);
  DequantizeNvfp4(Nvfp4Matrix{v.data(), s.data(), global, r0, cols}, OutputWindow{{r0, r1}, {0, cols}}, target,
                  WindowOut{rows.data()});
  std::memcpy(out, rows.data() + (first - r0 * cols) * ts, n * ts);
}

}  // namespace

void SynthDequantizedElements(uint64_t seed, const SynthQuantizedWeight& q, DType target, uint64_t first, uint64_t n,
                              void* out) {
  if (n == 0) return;
  if (q.weight_dtype == DType::kU8 && q.shape.size() == 2 && q.shape[1] % kNvfp4Block == 0) {
    return SynthNvfp4Elements(seed, q, target, first, n, out);
  }
  if (q.shape.size() != 2 || q.shape[1] == 0) {
    throw Error(ErrorKind::kInvalidArgument, q.key, "a block-quantized weight must be 2-D with columns");
  }
  //   rows [r0, r1) cover elements [first, first + n); dequantize them whole, hand back the part asked for
  const uint64_t cols = q.shape[1];
  const uint64_t r0 = first / cols, r1 = (first + n + cols - 1) / cols;
  const RowSpan g = ScaleRowsFor({r0, r1}, q.block);
  const uint64_t gc = ScaleGridFor(q.shape[0], cols, q.block).cols;
  const size_t ts = DTypeSize(target);
  std::vector<unsigned char> w((r1 - r0) * cols), s(g.size() * gc * DTypeSize(q.scale_dtype)), rows(w.size() * ts);
  SynthElements(seed, q.key, q.weight_dtype, r0 * cols, w.size(), w.data());
  SynthElements(seed, ScaleKeyFor(q.key), q.scale_dtype, g.begin * gc, g.size() * gc, s.data());
  Dequantize({q.weight_dtype, w.data()}, {q.scale_dtype, s.data(), gc}, {r0, r1}, cols, q.block, target, rows.data());
  std::memcpy(out, rows.data() + (first - r0 * cols) * ts, n * ts);
}

Bf16Twin MakeBf16Twin(const ModelSpec& spec) {
  std::unordered_map<std::string_view, const SpecEntry*> by_key;
  for (const auto& e : spec.entries) by_key.emplace(e.key, &e);
  const BlockSize block = ConfigBlockSize(spec);
  Bf16Twin twin;
  std::unordered_set<std::string> sidecars;
  const FindStored find = [&by_key](const std::string& key) -> std::optional<StoredTensor> {
    auto it = by_key.find(key);
    if (it == by_key.end()) return std::nullopt;
    return StoredTensor{it->second->dtype, &it->second->shape};
  };
  for (const auto& e : spec.entries) {
    const QuantMatch m = DetectQuant(find, e.key);  // the formats' own rules (loaders/quant/format.h)
    if (m.piece != QuantPiece::kData) continue;
    if (m.format == &kNvfp4Format) {  // NVFP4: U8 [out, in / 2] + its scales, named by its format
      const std::vector<std::string> partners = m.format->consumed(e.key);  // block, global, input scale
      auto sc = by_key.find(partners[0]);
      auto global = by_key.find(partners[1]);
      if (sc == by_key.end() || global == by_key.end()) continue;
      CheckNvfp4Triple(e.key, e.dtype, e.shape, sc->second->dtype, sc->second->shape, global->second->dtype,
                       global->second->shape);
      sidecars.insert(partners.begin(), partners.end());
      twin.dequantized.push_back({e.key, e.dtype, sc->second->dtype, m.format->model_shape(e.shape), {1, kNvfp4Block}});
      continue;
    }
    if (m.format != &kFp8Format || (e.dtype != DType::kF8_E4M3 && e.dtype != DType::kF8_E5M2)) continue;
    auto it = by_key.find(ScaleKeyFor(e.key));
    if (it == by_key.end()) continue;  // no scale: not block-quantized, stays as it is
    const SpecEntry& sc = *it->second;
    const ScaleGrid grid = e.shape.size() == 2 ? ScaleGridFor(e.shape[0], e.shape[1], block) : ScaleGrid{};
    if (e.shape.size() != 2 || sc.shape != std::vector<uint64_t>{grid.rows, grid.cols}) {
      throw Error(ErrorKind::kConfig, spec.source,
                  sc.key + " does not have the scale grid of " + e.key + " in blocks of " +
                      std::to_string(block.rows) + " x " + std::to_string(block.cols));
    }
    sidecars.insert(sc.key);
    twin.dequantized.push_back({e.key, e.dtype, sc.dtype, e.shape, block});
  }
  twin.spec = spec;
  twin.spec.entries.clear();
  std::unordered_map<std::string_view, const SynthQuantizedWeight*> dequantized;
  for (const auto& q : twin.dequantized) dequantized.emplace(q.key, &q);
  for (const auto& e : spec.entries) {
    if (sidecars.count(e.key)) continue;
    twin.spec.entries.push_back(e);
    if (auto q = dequantized.find(e.key); q != dequantized.end()) {
      twin.spec.entries.back().dtype = DType::kBF16;
      twin.spec.entries.back().shape = q->second->shape;  // NVFP4's [out, in], not its packed [out, in / 2]
    }
  }
  if (!twin.dequantized.empty()) twin.spec.config_json = ConfigWithoutQuantization(spec.config_json);
  return twin;
}

ModelSpec DequantizedSpec(const ModelSpec& spec, DType target) {
  if (target != DType::kBF16 && target != DType::kF16 && target != DType::kF32) {
    throw Error(ErrorKind::kInvalidArgument, "dtype",
                std::string(DTypeName(target)) + " is not a dequantization target (BF16, F16 or F32)");
  }
  Bf16Twin twin = MakeBf16Twin(spec);
  std::unordered_set<std::string_view> dequantized;
  for (const auto& q : twin.dequantized) dequantized.insert(q.key);
  for (auto& e : twin.spec.entries) {
    if (dequantized.count(e.key)) e.dtype = target;
  }
  return std::move(twin.spec);
}

uint64_t SynthFirstMismatch(uint64_t seed, std::string_view key, DType dtype, uint64_t first, uint64_t n,
                            const void* data) {
  const size_t es = DTypeSize(dtype);
  constexpr uint64_t kBlock = 4096;
  std::vector<unsigned char> expect(kBlock * es);
  const auto* got = static_cast<const unsigned char*>(data);
  for (uint64_t done = 0; done < n; done += kBlock) {
    uint64_t m = std::min(kBlock, n - done);
    SynthElements(seed, key, dtype, first + done, m, expect.data());
    if (std::memcmp(expect.data(), got + done * es, m * es) != 0) {
      for (uint64_t i = 0; i < m; ++i) {
        if (std::memcmp(expect.data() + i * es, got + (done + i) * es, es) != 0) return done + i;
      }
    }
  }
  return UINT64_MAX;
}

std::vector<WriteEntry> CheckpointEntries(const ModelSpec& spec) {
  std::vector<WriteEntry> out;
  for (const auto& e : spec.entries) {
    if (e.role == Role::kNonPersistentBuffer) continue;
    out.push_back(WriteEntry{e.key, e.dtype, e.shape});
  }
  return out;
}

WrittenCheckpoint WriteSynthCheckpoint(const ModelSpec& spec, const std::string& dir, const SynthOptions& options) {
  CheckpointWriteOptions w;
  w.max_shard_bytes = options.max_shard_bytes;
  w.sparse = options.sparse;
  w.metadata = {{"format", "pt"}, {"shardcast_synth_seed", std::to_string(options.seed)},
                {"shardcast_model_type", spec.model_type}};
  Bf16Twin twin;
  if (options.bf16_twin) {
    twin = MakeBf16Twin(spec);
    w.metadata.push_back({"shardcast_synth_bf16_twin", "true"});
  }
  std::unordered_map<std::string_view, const SynthQuantizedWeight*> dequantized;
  for (const auto& q : twin.dequantized) dequantized.emplace(q.key, &q);
  const uint64_t seed = options.seed;
  auto source = [seed, &dequantized](const WriteEntry& e, uint64_t offset, unsigned char* out, size_t n) {
    const size_t es = DTypeSize(e.dtype);
    if (offset % es != 0 || n % es != 0) {
      throw Error(ErrorKind::kInternal, e.key, "synth chunk not on an element boundary");
    }
    auto it = dequantized.find(e.key);
    if (it != dequantized.end()) {
      SynthDequantizedElements(seed, *it->second, e.dtype, offset / es, n / es, out);
    } else {
      SynthElements(seed, e.key, e.dtype, offset / es, n / es, out);
    }
  };
  return WriteCheckpoint(dir, CheckpointEntries(options.bf16_twin ? twin.spec : spec), source, w);
}

}  // namespace shardcast
