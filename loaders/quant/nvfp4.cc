#include "loaders/quant/nvfp4.h"

#include <algorithm>
#include <array>
#include <cstring>
#include <memory>
#include <string>

#include "allocators/error.h"
#include "loaders/shape.h"
#include "loaders/quant/dequant.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define SHARDCAST_NVFP4_X86 1
#define SHARDCAST_NVFP4_AVX2 __attribute__((target("avx2")))
#else
#define SHARDCAST_NVFP4_X86 0
#endif

// How it is laid out: one row at a time, one 16-value block at a time; v(2j) = low nibble of b(j),
// v(2j+1) = its high nibble:
//
//   stored row r:  | b0 b1 .. b7 | b8 .. b15 | ...      16 values (8 bytes) per E4M3 scale
//   values:        | v0 v1 .. v15| v16 .. v31| ...
//
// A block's 16 possible outputs depend on its scale byte alone (the global scale is one per tensor), so
// each scale byte's 16 target values are computed once, when first met, with the rule's exact
// arithmetic (E4M3 scale x global in f32, E2M1 value x that in f32, one rounding to the target); every
// value is then a table lookup, a whole block 8 bytes -> 16 values. For a 16-bit target the table is
// also kept as its 16 low and 16 high bytes, so that with AVX2 a whole block is two byte shuffles of
// its 16 nibbles and an interleave, in registers.

namespace shardcast {
namespace {

// Each scale byte's 16 outputs, built when the byte is first met.
template <typename Bits>
class BlockTables {
 public:
  BlockTables(float global, bool bf16) : global_(global), bf16_(bf16) {}
  const Bits* For(uint8_t scale) {
    Bits* t = values_ + scale * 16;
    if (!built_[scale]) {
      const float s = Fp8E4M3BitsToFloat(scale) * global_;  // one f32 rounding
      for (int q = 0; q < 16; ++q) t[q] = Convert(kE2M1[q] * s);
      built_[scale] = true;
    }
    return t;
  }
  // Two-byte targets: each of the scale's 256 value bytes as its two outputs, low nibble first (at the
  // lower address), one 32-bit store for two values.
  const uint32_t* Pairs(uint8_t scale) {
    if (!pairs_) pairs_.reset(new uint32_t[256 * 256]);
    uint32_t* p = pairs_.get() + scale * 256;
    if (!paired_[scale]) {
      const Bits* t = For(scale);
      for (int b = 0; b < 256; ++b) {
        const uint16_t lo = static_cast<uint16_t>(t[b & 0x0F]), hi = static_cast<uint16_t>(t[b >> 4]);
        const uint16_t two[2] = {lo, hi};
        std::memcpy(p + b, two, 4);
      }
      paired_[scale] = true;
    }
    return p;
  }
  // Two-byte targets: the scale's 16 outputs as their 16 low bytes, then their 16 high bytes.
  const uint8_t* Split(uint8_t scale) {
    uint8_t* p = split_ + scale * 32;
    if (!split_built_[scale]) {
      const Bits* t = For(scale);
      for (int q = 0; q < 16; ++q) {
        p[q] = static_cast<uint8_t>(t[q] & 0xFF);
        p[16 + q] = static_cast<uint8_t>((t[q] >> 8) & 0xFF);
      }
      split_built_[scale] = true;
    }
    return p;
  }

 private:
  Bits Convert(float v) const {
    if constexpr (sizeof(Bits) == 4) {  // F32: its own bits
      uint32_t u;
      std::memcpy(&u, &v, 4);
      return u;
    } else {
      return bf16_ ? FloatToBFloat16Bits(v) : FloatToHalfBits(v);
    }
  }
  float global_;
  bool bf16_;
  bool built_[256] = {};
  Bits values_[256 * 16];
  bool paired_[256] = {};
  bool split_built_[256] = {};
  uint8_t split_[256 * 32];
  std::unique_ptr<uint32_t[]> pairs_;  // 256 KiB, made on the first Pairs()
};

// The tables of the last kCachedTables (global scale, target) keys this thread used, most recent
// first: the tables depend on those two alone (the ISA only picks which parts are built, lazily), and
// they keep what earlier calls built, so that many small windows (tensor-parallel cuts) do not
// rebuild them per call. Thread-local, so no locking; up to ~17 KiB a key, and 256 KiB more for a
// 16-bit key the baseline kernel used.
constexpr size_t kCachedTables = 4;

struct CachedTables {
  uint32_t global_bits = 0;
  DType target = DType::kBF16;
  std::unique_ptr<BlockTables<uint16_t>> t16;  // BF16, F16
  std::unique_ptr<BlockTables<uint32_t>> t32;  // F32
};

thread_local uint64_t tables_built = 0;

CachedTables& TablesFor(float global, DType target) {
  thread_local std::array<CachedTables, kCachedTables> cache;
  thread_local size_t used = 0;
  uint32_t bits;
  std::memcpy(&bits, &global, 4);
  size_t i = 0;
  while (i < used && !(cache[i].global_bits == bits && cache[i].target == target)) ++i;
  if (i == used) {  // a miss: the least recent entry (or a free one) becomes this key's
    if (used < kCachedTables) ++used;
    i = used - 1;
    CachedTables& e = cache[i];
    e.global_bits = bits;
    e.target = target;
    e.t16.reset(target == DType::kF32 ? nullptr : new BlockTables<uint16_t>(global, target == DType::kBF16));
    e.t32.reset(target == DType::kF32 ? new BlockTables<uint32_t>(global, false) : nullptr);
    ++tables_built;
  }
  std::rotate(cache.begin(), cache.begin() + i, cache.begin() + i + 1);
  return cache[0];
}

// One block the window cuts, element by element.
template <typename Bits>
void CutBlock(const Bits* t, const uint8_t* v, uint64_t c, uint64_t end, unsigned char* at) {
  for (; c < end; ++c, at += sizeof(Bits)) {
    const uint8_t byte = v[c / 2];
    const Bits x = t[c % 2 ? byte >> 4 : byte & 0x0F];
    std::memcpy(at, &x, sizeof x);
  }
}

template <typename Bits>
void DequantizeRows(const Nvfp4Matrix& m, OutputWindow w, WindowOut out, BlockTables<Bits>* tables) {
  const uint64_t stride = out.row_stride ? out.row_stride : w.cols.size();
  const uint64_t row_bytes = m.cols / 2, row_blocks = m.cols / kNvfp4Block;
  for (uint64_t r = w.rows.begin; r < w.rows.end; ++r) {
    const uint8_t* v = m.values + (r - m.first_row) * row_bytes;
    const uint8_t* s = m.scales + (r - m.first_row) * row_blocks;
    unsigned char* o = static_cast<unsigned char*>(out.data) + (r - w.rows.begin) * stride * sizeof(Bits);
    for (uint64_t c = w.cols.begin; c < w.cols.end;) {
      const uint64_t b = c / kNvfp4Block, end = std::min(w.cols.end, (b + 1) * kNvfp4Block);
      const Bits* t = tables->For(s[b]);
      unsigned char* at = o + (c - w.cols.begin) * sizeof(Bits);
      if (c % kNvfp4Block == 0 && end - c == kNvfp4Block) {  // a whole block
        const uint8_t* bytes = v + c / 2;
        if constexpr (sizeof(Bits) == 2) {
          const uint32_t* pairs = tables->Pairs(s[b]);
          uint32_t block[kNvfp4Block / 2];
          for (int j = 0; j < 8; ++j) block[j] = pairs[bytes[j]];
          std::memcpy(at, block, sizeof block);
        } else {
          Bits block[kNvfp4Block];
          for (int j = 0; j < 8; ++j) {
            block[2 * j] = t[bytes[j] & 0x0F];
            block[2 * j + 1] = t[bytes[j] >> 4];
          }
          std::memcpy(at, block, sizeof block);
        }
        c = end;
        continue;
      }
      CutBlock(t, v, c, end, at);
      c = end;
    }
  }
}

#if SHARDCAST_NVFP4_X86
// 16-bit targets with AVX2: a whole block's 8 bytes -> 16 nibble indices in value order -> the low and
// the high bytes of their results by two shuffles of the scale's split table -> interleaved, stored.
SHARDCAST_NVFP4_AVX2 void Rows16Avx2(const Nvfp4Matrix& m, OutputWindow w, WindowOut out,
                                     BlockTables<uint16_t>* tables) {
  const uint64_t stride = out.row_stride ? out.row_stride : w.cols.size();
  const uint64_t row_bytes = m.cols / 2, row_blocks = m.cols / kNvfp4Block;
  const __m128i nibble = _mm_set1_epi8(0x0F);
  for (uint64_t r = w.rows.begin; r < w.rows.end; ++r) {
    const uint8_t* v = m.values + (r - m.first_row) * row_bytes;
    const uint8_t* s = m.scales + (r - m.first_row) * row_blocks;
    unsigned char* o = static_cast<unsigned char*>(out.data) + (r - w.rows.begin) * stride * 2;
    for (uint64_t c = w.cols.begin; c < w.cols.end;) {
      const uint64_t b = c / kNvfp4Block, end = std::min(w.cols.end, (b + 1) * kNvfp4Block);
      unsigned char* at = o + (c - w.cols.begin) * 2;
      if (c % kNvfp4Block == 0 && end - c == kNvfp4Block) {
        const uint8_t* split = tables->Split(s[b]);
        const __m128i x = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(v + c / 2));
        const __m128i idx = _mm_unpacklo_epi8(_mm_and_si128(x, nibble), _mm_and_si128(_mm_srli_epi16(x, 4), nibble));
        const __m128i lo = _mm_shuffle_epi8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(split)), idx);
        const __m128i hi = _mm_shuffle_epi8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(split + 16)), idx);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(at), _mm_unpacklo_epi8(lo, hi));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(at + 16), _mm_unpackhi_epi8(lo, hi));
      } else {
        CutBlock(tables->For(s[b]), v, c, end, at);
      }
      c = end;
    }
  }
}
#endif

}  // namespace

namespace nvfp4_internal {

void DequantizeWithIsa(dequant_internal::Isa isa, const Nvfp4Matrix& m, OutputWindow w, DType target, WindowOut out) {
  if (isa > dequant_internal::BestIsa()) {  // SupportedIsas() is every ISA up to the best
    throw Error(ErrorKind::kInvalidArgument, "nvfp4",
                "this CPU cannot run the " + std::string(dequant_internal::IsaName(isa)) + " kernels");
  }
  if (target != DType::kBF16 && target != DType::kF16 && target != DType::kF32) {
    throw Error(ErrorKind::kUnsupported, "nvfp4",
                "cannot dequantize NVFP4 to " + std::string(DTypeName(target)) + " (targets: BF16, F16 or F32)");
  }
  if (m.cols % kNvfp4Block != 0) {
    throw Error(ErrorKind::kInvalidArgument, "nvfp4", std::to_string(m.cols) + " values per row is not a multiple of 16");
  }
  if (w.rows.end < w.rows.begin || w.cols.end < w.cols.begin || w.cols.end > m.cols ||
      (w.rows.size() > 0 && w.rows.begin < m.first_row)) {
    throw Error(ErrorKind::kInvalidArgument, "nvfp4",
                "window rows [" + std::to_string(w.rows.begin) + ", " + std::to_string(w.rows.end) + ") x cols [" +
                    std::to_string(w.cols.begin) + ", " + std::to_string(w.cols.end) + ") is not within " +
                    std::to_string(m.cols) + " values per row and rows from " + std::to_string(m.first_row));
  }
  CachedTables& tables = TablesFor(m.global_scale, target);
  if (target == DType::kF32) return DequantizeRows(m, w, out, tables.t32.get());
#if SHARDCAST_NVFP4_X86
  if (isa != dequant_internal::Isa::kBaseline) return Rows16Avx2(m, w, out, tables.t16.get());
#endif
  DequantizeRows(m, w, out, tables.t16.get());
}

uint64_t TablesBuilt() { return tables_built; }

}  // namespace nvfp4_internal

void DequantizeNvfp4(const Nvfp4Matrix& m, OutputWindow w, DType target, WindowOut out) {
  nvfp4_internal::DequantizeWithIsa(dequant_internal::BestIsa(), m, w, target, out);
}

void CheckNvfp4Triple(std::string_view key, DType weight, const std::vector<uint64_t>& weight_shape, DType scale,
                      const std::vector<uint64_t>& scale_shape, DType global, const std::vector<uint64_t>& global_shape) {
  const bool ok = weight == DType::kU8 && scale == DType::kF8_E4M3 && global == DType::kF32 &&
                  weight_shape.size() == 2 && scale_shape.size() == 2 && scale_shape[0] == weight_shape[0] &&
                  scale_shape[1] * kNvfp4Block == weight_shape[1] * 2 && Numel(global_shape) == 1;
  if (!ok) {
    const std::string base(key.substr(0, key.size() >= 7 && key.substr(key.size() - 7) == ".weight" ? key.size() - 7
                                                                                                     : key.size()));
    throw Error(ErrorKind::kCheckpoint, "key '" + std::string(key) + "'",
                "NVFP4 weight " + std::string(DTypeName(weight)) + " " + ShapeText(weight_shape) + ", '" + base +
                    ".weight_scale' " + std::string(DTypeName(scale)) + " " + ShapeText(scale_shape) + " and '" + base +
                    ".weight_scale_2' " + std::string(DTypeName(global)) + " " + ShapeText(global_shape) +
                    " do not pair (U8 [out, in / 2], F8_E4M3 [out, in / 16], one F32)");
  }
}

}  // namespace shardcast
