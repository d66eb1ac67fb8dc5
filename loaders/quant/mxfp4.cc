#include "loaders/quant/mxfp4.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "allocators/error.h"
#include "loaders/shape.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define SHARDCAST_MXFP4_X86 1
#define SHARDCAST_MXFP4_AVX2 __attribute__((target("avx2")))
#else
#define SHARDCAST_MXFP4_X86 0
#endif

// How the kernel is fast:
//   - an output depends on (scale byte, nibble) only, so each 16-bit target has a 256 x 16 table of
//     result bits built once from the rule; F32 results are the BF16 ones shifted up 16 bits (every
//     result is exact in BF16: two significant bits, exponents 2^-128 .. 2^130, or inf);
//   - a 32-value group (16 bytes) is four byte shuffles of the group's two 16-byte tables (the low
//     and the high bytes of its 16 possible results) and an interleave, in registers;
//   - the transpose goes through a 32 x 64 tile in L1: 32 stored rows of two groups are decoded into
//     it, two rows per AVX2 register; 16 of its columns at a time go through 8 x 8 register
//     transposes into a band of 16 output rows of 32 elements (one cache line of BF16 each), and
//     each band row is written whole: non-temporal, past the cache, for a large output whose rows
//     start on lines (the first tile of a band is cut short to reach a line), plain stores otherwise.
//
//   stored rows ot .. ot+31, groups g, g+1     tile[k][j] = stored[ot + k][32 g + j]
//   +----+-------+----+                        band[q][k] = tile[k][j0 + q], q < 16
//   |    | g g+1 |    |  --decode-->  tile  --8x8 transposes-->  band  -->  out[32 g + j0 + q - i0][ot - o0 ..]
//   +----+-------+----+

namespace shardcast {
namespace {

enum TableIndex { kBF16Table = 0, kF16Table = 1 };

struct Tables {
  uint16_t bits[2][256][16];                 // [table][scale][nibble]: the result's bits
  alignas(16) uint8_t split[2][256][2][16];  // the same, [.][.][0]: low bytes, [1]: high bytes
};

const Tables& GetTables() {
  static const Tables* tables = [] {
    auto* t = new Tables;
    for (int s = 0; s < 256; ++s) {
      for (int n = 0; n < 16; ++n) {
        const float v = std::ldexp(kE2M1[n], s - 127);  // exact, or inf
        const uint16_t b[2] = {FloatToBFloat16Bits(v), FloatToHalfBits(v)};
        for (int k = 0; k < 2; ++k) {
          t->bits[k][s][n] = b[k];
          t->split[k][s][0][n] = static_cast<uint8_t>(b[k] & 0xFF);
          t->split[k][s][1][n] = static_cast<uint8_t>(b[k] >> 8);
        }
      }
    }
    return t;
  }();
  return *tables;
}

// F32 results come from the BF16 table: its bits are the F32 result's top half.
int TableFor(DType target) { return target == DType::kF16 ? kF16Table : kBF16Table; }

void StoreBits(DType target, unsigned char* out, uint64_t i, uint16_t bits) {
  if (target == DType::kF32) {
    const uint32_t w = static_cast<uint32_t>(bits) << 16;
    std::memcpy(out + 4 * i, &w, 4);
  } else {
    std::memcpy(out + 2 * i, &bits, 2);
  }
}

// The stored matrix's rows as the kernels address them.
struct Rows {
  const uint8_t* blocks;
  const uint8_t* scales;
  uint64_t first_row, row_bytes, row_groups;

  explicit Rows(const Mxfp4Matrix& m)
      : blocks(m.blocks), scales(m.scales), first_row(m.first_row), row_bytes(m.cols / 2),
        row_groups(m.cols / kMxfp4Group) {}
  const uint8_t* Group(uint64_t r, uint64_t g) const { return blocks + (r - first_row) * row_bytes + g * 16; }
  uint8_t Scale(uint64_t r, uint64_t g) const { return scales[(r - first_row) * row_groups + g]; }
  uint16_t Bits(const Tables& t, int table, uint64_t r, uint64_t c) const {
    const uint8_t b = Group(r, c / kMxfp4Group)[(c % kMxfp4Group) / 2];
    return t.bits[table][Scale(r, c / kMxfp4Group)][c % 2 ? b >> 4 : b & 0x0F];
  }
};

uint64_t Stride(const OutputWindow& w, const WindowOut& out) {
  return out.row_stride ? out.row_stride : w.cols.size();
}

// --- baseline: one element at a time, any CPU -----------------------------------------------

void StoredBaseline(const Rows& m, OutputWindow w, DType target, unsigned char* out, uint64_t stride) {
  const Tables& t = GetTables();
  const int table = TableFor(target);
  const size_t ts = DTypeSize(target);
  for (uint64_t r = w.rows.begin; r < w.rows.end; ++r) {
    unsigned char* o = out + (r - w.rows.begin) * stride * ts;
    for (uint64_t c = w.cols.begin; c < w.cols.end; ++c) StoreBits(target, o, c - w.cols.begin, m.Bits(t, table, r, c));
  }
}

void TransposedBaseline(const Rows& m, OutputWindow w, DType target, unsigned char* out, uint64_t stride) {
  const Tables& t = GetTables();
  const int table = TableFor(target);
  const size_t ts = DTypeSize(target);
  for (uint64_t i = w.rows.begin; i < w.rows.end; ++i) {
    unsigned char* o = out + (i - w.rows.begin) * stride * ts;
    for (uint64_t r = w.cols.begin; r < w.cols.end; ++r) StoreBits(target, o, r - w.cols.begin, m.Bits(t, table, r, i));
  }
}

#if SHARDCAST_MXFP4_X86

// One group's 32 results as 16-bit bits, in four vectors of 8 (values 0-7, 8-15, 16-23, 24-31).
struct Group16 {
  __m128i v[4];
};

SHARDCAST_MXFP4_AVX2 inline Group16 DecodeGroup(const uint8_t* bytes, const uint8_t (*split)[16]) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes));
  const __m128i nib = _mm_set1_epi8(0x0F);
  const __m128i lo = _mm_and_si128(b, nib), hi = _mm_and_si128(_mm_srli_epi16(b, 4), nib);
  const __m128i tl = _mm_load_si128(reinterpret_cast<const __m128i*>(split[0]));
  const __m128i th = _mm_load_si128(reinterpret_cast<const __m128i*>(split[1]));
  // value 2j is the low nibble of byte j, value 2j + 1 its high nibble
  const __m128i even_l = _mm_shuffle_epi8(tl, lo), even_h = _mm_shuffle_epi8(th, lo);
  const __m128i odd_l = _mm_shuffle_epi8(tl, hi), odd_h = _mm_shuffle_epi8(th, hi);
  const __m128i even0 = _mm_unpacklo_epi8(even_l, even_h), even1 = _mm_unpackhi_epi8(even_l, even_h);
  const __m128i odd0 = _mm_unpacklo_epi8(odd_l, odd_h), odd1 = _mm_unpackhi_epi8(odd_l, odd_h);
  return Group16{{_mm_unpacklo_epi16(even0, odd0), _mm_unpackhi_epi16(even0, odd0), _mm_unpacklo_epi16(even1, odd1),
                  _mm_unpackhi_epi16(even1, odd1)}};
}

// Eight 16-bit results to `out` (element i of the output row): as they are, or widened to F32.
SHARDCAST_MXFP4_AVX2 inline void Store8(DType target, unsigned char* out, uint64_t i, __m128i v) {
  if (target == DType::kF32) {
    const __m128i zero = _mm_setzero_si128();
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + 4 * i), _mm_unpacklo_epi16(zero, v));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + 4 * i + 16), _mm_unpackhi_epi16(zero, v));
  } else {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + 2 * i), v);
  }
}

SHARDCAST_MXFP4_AVX2 void StoredAvx2(const Rows& m, OutputWindow w, DType target, unsigned char* out,
                                     uint64_t stride) {
  const Tables& t = GetTables();
  const int table = TableFor(target);
  const size_t ts = DTypeSize(target);
  for (uint64_t r = w.rows.begin; r < w.rows.end; ++r) {
    unsigned char* o = out + (r - w.rows.begin) * stride * ts;
    uint64_t c = w.cols.begin;
    for (; c < w.cols.end && c % kMxfp4Group != 0; ++c) StoreBits(target, o, c - w.cols.begin, m.Bits(t, table, r, c));
    for (; c + kMxfp4Group <= w.cols.end; c += kMxfp4Group) {
      const uint64_t g = c / kMxfp4Group;
      const Group16 x = DecodeGroup(m.Group(r, g), t.split[table][m.Scale(r, g)]);
      for (int k = 0; k < 4; ++k) Store8(target, o, c - w.cols.begin + 8 * k, x.v[k]);
    }
    for (; c < w.cols.end; ++c) StoreBits(target, o, c - w.cols.begin, m.Bits(t, table, r, c));
  }
}

// Two stored rows' groups at once, row 0 in the low 128-bit lane and row 1 in the high one: the same
// shuffles as DecodeGroup, lane by lane. Lane 0 of v[q] is row 0's values 8q .. 8q + 7, lane 1 row 1's.
SHARDCAST_MXFP4_AVX2 inline void DecodeGroupPair(const uint8_t* bytes0, const uint8_t* bytes1,
                                                 const uint8_t (*split0)[16], const uint8_t (*split1)[16],
                                                 __m256i v[4]) {
  const __m256i b = _mm256_loadu2_m128i(reinterpret_cast<const __m128i*>(bytes1),
                                        reinterpret_cast<const __m128i*>(bytes0));
  const __m256i nib = _mm256_set1_epi8(0x0F);
  const __m256i lo = _mm256_and_si256(b, nib), hi = _mm256_and_si256(_mm256_srli_epi16(b, 4), nib);
  const __m256i tl = _mm256_loadu2_m128i(reinterpret_cast<const __m128i*>(split1[0]),
                                         reinterpret_cast<const __m128i*>(split0[0]));
  const __m256i th = _mm256_loadu2_m128i(reinterpret_cast<const __m128i*>(split1[1]),
                                         reinterpret_cast<const __m128i*>(split0[1]));
  const __m256i even_l = _mm256_shuffle_epi8(tl, lo), even_h = _mm256_shuffle_epi8(th, lo);
  const __m256i odd_l = _mm256_shuffle_epi8(tl, hi), odd_h = _mm256_shuffle_epi8(th, hi);
  const __m256i even0 = _mm256_unpacklo_epi8(even_l, even_h), even1 = _mm256_unpackhi_epi8(even_l, even_h);
  const __m256i odd0 = _mm256_unpacklo_epi8(odd_l, odd_h), odd1 = _mm256_unpackhi_epi8(odd_l, odd_h);
  v[0] = _mm256_unpacklo_epi16(even0, odd0);
  v[1] = _mm256_unpackhi_epi16(even0, odd0);
  v[2] = _mm256_unpacklo_epi16(even1, odd1);
  v[3] = _mm256_unpackhi_epi16(even1, odd1);
}

// Each 128-bit lane of a[0..7] (8 x 16-bit) as an 8 x 8 matrix, rows a[0..7] -> a[m] = column m, in
// both lanes at once.
SHARDCAST_MXFP4_AVX2 inline void Transpose8x8Lanes(__m256i a[8]) {
  const __m256i t0 = _mm256_unpacklo_epi16(a[0], a[1]), t1 = _mm256_unpackhi_epi16(a[0], a[1]);
  const __m256i t2 = _mm256_unpacklo_epi16(a[2], a[3]), t3 = _mm256_unpackhi_epi16(a[2], a[3]);
  const __m256i t4 = _mm256_unpacklo_epi16(a[4], a[5]), t5 = _mm256_unpackhi_epi16(a[4], a[5]);
  const __m256i t6 = _mm256_unpacklo_epi16(a[6], a[7]), t7 = _mm256_unpackhi_epi16(a[6], a[7]);
  const __m256i u0 = _mm256_unpacklo_epi32(t0, t2), u1 = _mm256_unpackhi_epi32(t0, t2);
  const __m256i u2 = _mm256_unpacklo_epi32(t1, t3), u3 = _mm256_unpackhi_epi32(t1, t3);
  const __m256i u4 = _mm256_unpacklo_epi32(t4, t6), u5 = _mm256_unpackhi_epi32(t4, t6);
  const __m256i u6 = _mm256_unpacklo_epi32(t5, t7), u7 = _mm256_unpackhi_epi32(t5, t7);
  a[0] = _mm256_unpacklo_epi64(u0, u4);
  a[1] = _mm256_unpackhi_epi64(u0, u4);
  a[2] = _mm256_unpacklo_epi64(u1, u5);
  a[3] = _mm256_unpackhi_epi64(u1, u5);
  a[4] = _mm256_unpacklo_epi64(u2, u6);
  a[5] = _mm256_unpackhi_epi64(u2, u6);
  a[6] = _mm256_unpacklo_epi64(u3, u7);
  a[7] = _mm256_unpackhi_epi64(u3, u7);
}

constexpr uint64_t kTileRows = 32;   // stored rows per tile
constexpr uint64_t kTileGroups = 2;  // groups per tile: half a 64-byte line of each stored row
constexpr uint64_t kTileValues = kTileGroups * kMxfp4Group;
constexpr uint64_t kBandValues = 16;  // output rows transposed at a time

// tile.v[k][j] = stored[ot + k][value0 + j] as 16-bit result bits, value0 = 32 gt.
struct Tile {
  alignas(64) uint16_t v[kTileRows][kTileValues];
};

// Up to 16 output rows of a tile: band[q][k] = tile.v[k][j + q].
struct Band {
  alignas(64) uint16_t v[kBandValues][kTileRows];
};

// Where results go: output row i (a value, in) column o (a stored row, out). With `stream`, a tile of
// 32 stored rows starts each output row at a 64-byte line (BF16 / F16: one line, F32: two), and
// whole tiles are written with non-temporal stores.
struct TileOut {
  DType target;
  unsigned char* out;
  uint64_t stride_bytes, ts;
  uint64_t i0, o0;  // the window's first row and column
  bool stream;
  unsigned char* At(uint64_t i, uint64_t o) const { return out + (i - i0) * stride_bytes + (o - o0) * ts; }
};

// band.v[q][k] for q < n, k < rows: 8 x 8 lane transposes where 16 values and 8 rows are whole.
SHARDCAST_MXFP4_AVX2 void TransposeBand(const Tile& tile, uint64_t j, uint64_t n, uint64_t rows, Band* band) {
  uint64_t k0 = 0;
  if (n == kBandValues) {
    for (; k0 + 8 <= rows; k0 += 8) {
      __m256i a[8];
      for (int k = 0; k < 8; ++k) a[k] = _mm256_load_si256(reinterpret_cast<const __m256i*>(&tile.v[k0 + k][j]));
      Transpose8x8Lanes(a);
      for (int q = 0; q < 8; ++q) {
        _mm_store_si128(reinterpret_cast<__m128i*>(&band->v[q][k0]), _mm256_castsi256_si128(a[q]));
        _mm_store_si128(reinterpret_cast<__m128i*>(&band->v[8 + q][k0]), _mm256_extracti128_si256(a[q], 1));
      }
    }
  }
  for (uint64_t q = 0; q < n; ++q) {
    for (uint64_t k = k0; k < rows; ++k) band->v[q][k] = tile.v[k][j + q];
  }
}

// One band row's `rows` results to `at`: non-temporal whole lines when `stream` (then rows is 32 and
// `at` 64-byte aligned), plain stores otherwise.
SHARDCAST_MXFP4_AVX2 void EmitRow(DType target, const uint16_t* row, uint64_t rows, bool stream, unsigned char* at) {
  uint64_t k = 0;
  if (target == DType::kF32) {
    for (; k + 8 <= rows; k += 8) {
      const __m128i x = _mm_load_si128(reinterpret_cast<const __m128i*>(row + k));
      const __m256i w = _mm256_slli_epi32(_mm256_cvtepu16_epi32(x), 16);
      if (stream) {
        _mm256_stream_si256(reinterpret_cast<__m256i*>(at + 4 * k), w);
      } else {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(at + 4 * k), w);
      }
    }
  } else {
    for (; k + 16 <= rows; k += 16) {
      const __m256i x = _mm256_load_si256(reinterpret_cast<const __m256i*>(row + k));
      if (stream) {
        _mm256_stream_si256(reinterpret_cast<__m256i*>(at + 2 * k), x);
      } else {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(at + 2 * k), x);
      }
    }
  }
  for (; k < rows; ++k) StoreBits(target, at, k, row[k]);
}

// Writes output rows [va, vb) (values of the tile's groups, from value0 on), columns ot .. ot + rows - 1.
SHARDCAST_MXFP4_AVX2 void WriteTile(const Tile& tile, uint64_t value0, uint64_t ot, uint64_t rows, uint64_t va,
                                    uint64_t vb, const TileOut& to) {
  const bool stream = to.stream && rows == kTileRows;
  Band band;
  for (uint64_t v = va; v < vb;) {
    // 16 values from a multiple of 16, or the values up to the next one
    const uint64_t n = std::min(vb - v, kBandValues - (v - value0) % kBandValues);
    TransposeBand(tile, v - value0, n, rows, &band);
    for (uint64_t q = 0; q < n; ++q) EmitRow(to.target, band.v[q], rows, stream, to.At(v + q, ot));
    v += n;
  }
}

// Stored rows [ot, ot + rows), groups [ga, gb) of the tile from group gt on, decoded into `tile`.
SHARDCAST_MXFP4_AVX2 void DecodeTile(const Rows& m, const uint8_t (*split)[2][16], uint64_t ot, uint64_t rows,
                                     uint64_t gt, uint64_t ga, uint64_t gb, uint64_t prefetch_end, Tile* tile) {
  for (uint64_t k = 0; k < rows; k += 2) {
    for (uint64_t d = 0; d < 2; ++d) {  // the rows two tiles on, while these are decoded
      const uint64_t ahead = ot + k + d + 2 * kTileRows;
      if (ahead < prefetch_end) {
        _mm_prefetch(reinterpret_cast<const char*>(m.Group(ahead, ga)), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(&m.scales[(ahead - m.first_row) * m.row_groups + ga]), _MM_HINT_T0);
      }
    }
    const uint64_t k1 = std::min(k + 1, rows - 1);  // an odd last row decodes itself twice
    for (uint64_t g = ga; g < gb; ++g) {
      __m256i x[4];
      DecodeGroupPair(m.Group(ot + k, g), m.Group(ot + k1, g), split[m.Scale(ot + k, g)], split[m.Scale(ot + k1, g)], x);
      uint16_t* r0 = &tile->v[k][(g - gt) * kMxfp4Group];
      uint16_t* r1 = &tile->v[k1][(g - gt) * kMxfp4Group];
      for (int q = 0; q < 4; ++q) {
        _mm_store_si128(reinterpret_cast<__m128i*>(r0 + 8 * q), _mm256_castsi256_si128(x[q]));
        _mm_store_si128(reinterpret_cast<__m128i*>(r1 + 8 * q), _mm256_extracti128_si256(x[q], 1));
      }
    }
  }
}

SHARDCAST_MXFP4_AVX2 void TransposedAvx2(const Rows& m, OutputWindow w, DType target, unsigned char* out,
                                         uint64_t stride, uint64_t stream_min_bytes) {
  const Tables& t = GetTables();
  const uint8_t(*split)[2][16] = t.split[TableFor(target)];
  const size_t ts = DTypeSize(target);
  const uintptr_t misalign = reinterpret_cast<uintptr_t>(out) % 64;
  const bool stream = w.rows.size() * stride * ts >= stream_min_bytes && stride * ts % 64 == 0 && misalign % ts == 0;
  // Columns before row i0's first whole line: a tile of their own, so that the others are whole lines.
  const uint64_t lead = stream ? (64 - misalign) % 64 / ts : 0;
  const TileOut to{target, out, stride * ts, ts, w.rows.begin, w.cols.begin, stream};
  Tile tile;
  const uint64_t g0 = w.rows.begin / kMxfp4Group, g1 = (w.rows.end + kMxfp4Group - 1) / kMxfp4Group;
  // Tiles of 2 groups (64 output rows) outer, stored rows inner: the 64 output rows are written left
  // to right, 32 columns at a time, and a stored row's 64-byte line is read by two bands in turn.
  // 1, 4 and 8 groups a tile measured slower than 2 (bench/RESULTS.md's machine).
  for (uint64_t gt = g0 / kTileGroups * kTileGroups; gt < g1; gt += kTileGroups) {
    const uint64_t ga = std::max(gt, g0), gb = std::min(gt + kTileGroups, g1);
    const uint64_t value0 = gt * kMxfp4Group;
    const uint64_t va = std::max(w.rows.begin, ga * kMxfp4Group), vb = std::min(w.rows.end, gb * kMxfp4Group);
    for (uint64_t ot = w.cols.begin, rows = 0; ot < w.cols.end; ot += rows) {
      rows = std::min(w.cols.end - ot, ot < w.cols.begin + lead ? w.cols.begin + lead - ot : kTileRows);
      DecodeTile(m, split, ot, rows, gt, ga, gb, w.cols.end, &tile);
      WriteTile(tile, value0, ot, rows, va, vb, to);
    }
  }
  if (stream) _mm_sfence();
}

#endif  // SHARDCAST_MXFP4_X86

bool IsTarget(DType d) { return d == DType::kBF16 || d == DType::kF16 || d == DType::kF32; }

std::string SpanText(RowSpan s) { return "[" + std::to_string(s.begin) + ", " + std::to_string(s.end) + ")"; }

// Throws unless the window lies within what the call may read: out_rows x out_cols of the output,
// stored rows from first_row on.
void CheckWindow(const Mxfp4Matrix& m, OutputWindow w, DType target, mxfp4_internal::Layout layout) {
  if (!IsTarget(target)) {
    throw Error(ErrorKind::kUnsupported, "mxfp4",
                "cannot dequantize MXFP4 to " + std::string(DTypeName(target)) + " (targets: BF16, F16 or F32)");
  }
  if (m.cols % kMxfp4Group != 0) {
    throw Error(ErrorKind::kInvalidArgument, "mxfp4",
                std::to_string(m.cols) + " values per stored row is not a multiple of 32");
  }
  const bool stored = layout == mxfp4_internal::Layout::kStored;
  const RowSpan stored_rows = stored ? w.rows : w.cols, values = stored ? w.cols : w.rows;
  if (w.rows.end < w.rows.begin || w.cols.end < w.cols.begin || values.end > m.cols ||
      (stored_rows.size() > 0 && stored_rows.begin < m.first_row)) {
    throw Error(ErrorKind::kInvalidArgument, "mxfp4",
                std::string(stored ? "stored" : "transposed") + " window rows " + SpanText(w.rows) + " x cols " +
                    SpanText(w.cols) + " is not within " + std::to_string(m.cols) +
                    " values per stored row and stored rows from " + std::to_string(m.first_row));
  }
}

}  // namespace

bool CanDequantizeMxfp4(DType blocks, DType scales, DType target) {
  return blocks == DType::kU8 && (scales == DType::kU8 || scales == DType::kF8_E8M0) && IsTarget(target);
}

namespace mxfp4_internal {

void DequantizeWithIsa(dequant_internal::Isa isa, const Mxfp4Matrix& m, OutputWindow w, DType target, WindowOut out,
                       Layout layout, KernelOptions options) {
  if (isa > dequant_internal::BestIsa()) {  // SupportedIsas() is every ISA up to the best
    throw Error(ErrorKind::kInvalidArgument, "mxfp4",
                "this CPU cannot run the " + std::string(dequant_internal::IsaName(isa)) + " kernels");
  }
  CheckWindow(m, w, target, layout);
  if (w.rows.size() == 0 || w.cols.size() == 0) return;
  const Rows rows(m);
  auto* o = static_cast<unsigned char*>(out.data);
  const uint64_t stride = Stride(w, out);
#if SHARDCAST_MXFP4_X86
  if (isa != dequant_internal::Isa::kBaseline) {
    if (layout == Layout::kStored) return StoredAvx2(rows, w, target, o, stride);
    return TransposedAvx2(rows, w, target, o, stride, options.stream_min_bytes);
  }
#endif
  if (layout == Layout::kStored) return StoredBaseline(rows, w, target, o, stride);
  TransposedBaseline(rows, w, target, o, stride);
}

}  // namespace mxfp4_internal

void DequantizeMxfp4(const Mxfp4Matrix& m, OutputWindow w, DType target, WindowOut out) {
  mxfp4_internal::DequantizeWithIsa(dequant_internal::BestIsa(), m, w, target, out,
                                    mxfp4_internal::Layout::kStored);
}

void DequantizeMxfp4Transposed(const Mxfp4Matrix& m, OutputWindow w, DType target, WindowOut out) {
  mxfp4_internal::DequantizeWithIsa(dequant_internal::BestIsa(), m, w, target, out,
                                    mxfp4_internal::Layout::kTransposed);
}

std::string Mxfp4BlocksKey(std::string_view param_key) { return std::string(param_key) + "_blocks"; }
std::string Mxfp4ScalesKey(std::string_view param_key) { return std::string(param_key) + "_scales"; }

std::vector<uint64_t> Mxfp4ModelShape(const std::vector<uint64_t>& b) {
  if (b.size() < 3 || b.back() != 16) return {};
  std::vector<uint64_t> out(b.begin(), b.end() - 3);
  out.push_back(b[b.size() - 2] * kMxfp4Group);
  out.push_back(b[b.size() - 3]);
  return out;
}

void CheckMxfp4Pair(std::string_view key, DType blocks_dtype, const std::vector<uint64_t>& blocks_shape,
                    DType scales_dtype, const std::vector<uint64_t>& scales_shape,
                    const std::vector<uint64_t>& model_shape, DType target) {
  const std::string context = "key '" + std::string(key) + "'";
  const std::vector<uint64_t> want = Mxfp4ModelShape(blocks_shape);
  const bool paired = !want.empty() &&
                      std::vector<uint64_t>(blocks_shape.begin(), blocks_shape.end() - 1) == scales_shape;
  if (!paired || want != model_shape) {
    throw Error(ErrorKind::kCheckpoint, context,
                "MXFP4 pair '" + Mxfp4BlocksKey(key) + "' " + ShapeText(blocks_shape) + " and '" + Mxfp4ScalesKey(key) +
                    "' " + ShapeText(scales_shape) + " does not make the model's " + ShapeText(model_shape) +
                    " (blocks [..., out, in / 32, 16] and scales [..., out, in / 32] make [..., in, out])");
  }
  if (!CanDequantizeMxfp4(blocks_dtype, scales_dtype, target)) {
    throw Error(ErrorKind::kUnsupported, context,
                "cannot dequantize MXFP4 blocks " + std::string(DTypeName(blocks_dtype)) + " with scales " +
                    std::string(DTypeName(scales_dtype)) + " to " + std::string(DTypeName(target)) +
                    " (blocks: U8; scales: U8 or F8_E8M0; targets: BF16, F16 or F32)");
  }
}

}  // namespace shardcast
