#include "loaders/synth.h"

#include <xxhash.h>

#include <cstring>
#include <vector>

#include "allocators/error.h"

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

}  // namespace

uint64_t SynthTensorSeed(uint64_t seed, std::string_view key) {
  return XXH3_64bits_withSeed(key.data(), key.size(), seed);
}

void SynthElements(uint64_t seed, std::string_view key, DType dtype, uint64_t first, uint64_t n, void* dst) {
  const uint64_t base = SynthTensorSeed(seed, key);
  auto* out = static_cast<unsigned char*>(dst);
  for (uint64_t i = 0; i < n; ++i) {
    const uint64_t h = Mix(base + (first + i) * 0x9E3779B97F4A7C15ull);
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
      case DType::kF8_E4M3: out[i] = FloatBits<unsigned char>(h, 3, 4, 1, 7); break;
      case DType::kF8_E5M2: out[i] = FloatBits<unsigned char>(h, 2, 5, 8, 7); break;
      case DType::kF8_E8M0: out[i] = static_cast<unsigned char>(120 + (h >> 40) % 8); break;
      case DType::kC64:
        Store(out, 2 * i, FloatBits<uint32_t>(h, 23, 8, 120, 7));
        Store(out, 2 * i + 1, FloatBits<uint32_t>(Mix(h), 23, 8, 120, 7));
        break;
    }
  }
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
  const uint64_t seed = options.seed;
  auto source = [seed](const WriteEntry& e, uint64_t offset, unsigned char* out, size_t n) {
    const size_t es = DTypeSize(e.dtype);
    if (offset % es != 0 || n % es != 0) {
      throw Error(ErrorKind::kInternal, e.key, "synth chunk not on an element boundary");
    }
    SynthElements(seed, e.key, e.dtype, offset / es, n / es, out);
  };
  return WriteCheckpoint(dir, CheckpointEntries(spec), source, w);
}

}  // namespace shardcast
