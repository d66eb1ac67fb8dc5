#include "loaders/nvfp4.h"

#include <cstring>
#include <string>

#include "allocators/error.h"

// How it is laid out: one row at a time, one 16-value block at a time; the block's scale is decoded
// and multiplied by the global scale once, then the block's 8 bytes give 16 products.
//
//   stored row r:  | b0 b1 .. b7 | b8 .. b15 | ...      16 values (8 bytes) per E4M3 scale
//   values:        | v0 v1 .. v15| v16 .. v31| ...      v(2j) = low nibble of b(j), v(2j+1) = high

namespace shardcast {
namespace {

constexpr float kE2M1[16] = {0.0f,  0.5f,  1.0f,  1.5f,  2.0f,  3.0f,  4.0f,  6.0f,
                             -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

void Store(DType target, unsigned char* out, uint64_t i, float v) {
  if (target == DType::kF32) {
    std::memcpy(out + 4 * i, &v, 4);
    return;
  }
  const uint16_t h = target == DType::kBF16 ? FloatToBFloat16Bits(v) : FloatToHalfBits(v);
  std::memcpy(out + 2 * i, &h, 2);
}

std::string ShapeText(const std::vector<uint64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

uint64_t Numel(const std::vector<uint64_t>& s) {
  uint64_t n = 1;
  for (uint64_t d : s) n *= d;
  return n;
}

}  // namespace

void DequantizeNvfp4(const Nvfp4Matrix& m, OutputWindow w, DType target, WindowOut out) {
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
  const size_t ts = DTypeSize(target);
  const uint64_t stride = out.row_stride ? out.row_stride : w.cols.size();
  const uint64_t row_bytes = m.cols / 2, row_blocks = m.cols / kNvfp4Block;
  for (uint64_t r = w.rows.begin; r < w.rows.end; ++r) {
    const uint8_t* v = m.values + (r - m.first_row) * row_bytes;
    const uint8_t* s = m.scales + (r - m.first_row) * row_blocks;
    unsigned char* o = static_cast<unsigned char*>(out.data) + (r - w.rows.begin) * stride * ts;
    for (uint64_t c = w.cols.begin; c < w.cols.end;) {
      const uint64_t b = c / kNvfp4Block, end = std::min(w.cols.end, (b + 1) * kNvfp4Block);
      const float scale = Fp8E4M3BitsToFloat(s[b]) * m.global_scale;  // one f32 rounding
      for (; c < end; ++c) {
        const uint8_t byte = v[c / 2];
        Store(target, o, c - w.cols.begin, kE2M1[c % 2 ? byte >> 4 : byte & 0x0F] * scale);
      }
    }
  }
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
