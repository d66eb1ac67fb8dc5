// loaders/mxfp4: MXFP4 weights (OCP microscaling, as gpt-oss ships its experts) to bf16 / f16 / f32,
// the pure kernel of MXFP4 loading.
//
// gpt-oss stores each MoE projection "<name>" as a pair of checkpoint tensors:
//   "<name>_blocks"  U8 [E, rows, cols / 32, 16]  two E2M1 values a byte, the low nibble first
//   "<name>_scales"  U8 or F8_E8M0 [E, rows, cols / 32]  one E8M0 exponent per 32 values of a row
// An expert's stored matrix is [rows, cols] = [out, in]. The model's parameter "<name>" is its
// transpose, [E, in, out] = [E, cols, rows] (transformers' convert_moe_packed_tensors ends in
// transpose(1, 2)).
//
// The rule, per element, bit-identical to convert_moe_packed_tensors (FP4_VALUES[nibble] in the
// target dtype, then torch.ldexp(value, scale - 127)):
//   stored[r][c] = round_to_nearest_even<target>(E2M1(nibble(r, c)) * 2^(scale[r][c / 32] - 127))
//   E2M1 = {0, .5, 1, 1.5, 2, 3, 4, 6, -0, -.5, -1, -1.5, -2, -3, -4, -6}[nibble]
// The product is exact (an E2M1 value has two significant bits; |product| in [2^-128, 6 * 2^128]),
// so the result has one rounding: to F32 and BF16 it is exact or overflows to inf; to F16 it rounds to
// a subnormal or zero below 2^-14 and overflows above 65504. E8M0 255 is 2^128 here, as transformers
// reads it (the OCP spec calls it NaN), so no NaN is ever produced. -0 (nibble 8) stays -0.
//
// A call writes one window of the stored matrix, or of its transpose, row-major:
//
//     stored [rows = out, cols = in]            transposed [cols = in, rows = out]: the model's
//           c0        c1                              o0        o1
//     +-----+---------+-----+               +-------+---------+---+
//  r0 |     |/////////|     |            i0 |       |/////////|   |   out[i - i0][o - o0]
//     |     |/////////|     |               |       |/////////|   |     = stored[o][i]
//  r1 +-----+---------+-----+            i1 +-------+---------+---+
//
// A stored window reads stored rows [r0, r1) and their 32-value groups [c0 / 32, ceil(c1 / 32)); a
// transposed window rows [i0, i1) x cols [o0, o1) reads stored rows [o0, o1) and groups
// [i0 / 32, ceil(i1 / 32)). A reader that produces the model's rows of one expert reads that expert's
// packed bytes (a quarter of its bf16 size) and writes the transpose straight into its output: no
// dequantized full tensor, no dequantized expert in scratch.
//
// Thread safety: pure functions (the tables are built once, thread-safely, on first use).
// Single-threaded; callers parallelize by splitting windows, and any split gives the same bytes.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "loaders/quant/dequant.h"
#include "loaders/dtype.h"

namespace shardcast {

// The 16 values of an FP4 E2M1 nibble (sign, 2 exponent bits, 1 mantissa bit), the element type of
// both MXFP4 and NVFP4 (nvfp4.h): one table for both kernels.
inline constexpr float kE2M1[16] = {0.0f,  0.5f,  1.0f,  1.5f,  2.0f,  3.0f,  4.0f,  6.0f,
                                    -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

// One expert's stored matrix, or the rows of it a call reads. No alignment needed.
struct Mxfp4Matrix {
  const uint8_t* blocks = nullptr;  // stored rows from first_row on, cols / 2 bytes each
  const uint8_t* scales = nullptr;  // the same rows' E8M0 scales, cols / 32 bytes each
  uint64_t first_row = 0;           // default 0: the stored row `blocks` and `scales` begin at
  uint64_t cols = 0;                // values per stored row (in); a multiple of 32
};

// Half-open rows x columns of an output (the stored matrix, or its transpose).
struct OutputWindow {
  RowSpan rows, cols;
};

// Where a window lands: rows of `row_stride` elements of the target dtype (0, the default: the
// window's width, i.e. packed). No alignment needed.
struct WindowOut {
  void* data = nullptr;
  uint64_t row_stride = 0;
};

inline constexpr uint64_t kMxfp4Group = 32;  // values per scale

bool CanDequantizeMxfp4(DType blocks, DType scales, DType target);

// Writes window `w` of the stored matrix [*, m.cols]. REQUIRES: m holds stored rows
// [w.rows.begin, w.rows.end) from m.first_row on; out does not overlap m.
// Throws kUnsupported for a target other than BF16, F16 or F32; kInvalidArgument for m.cols not a
// multiple of 32, a window outside [0, m.cols) columns or before m.first_row, or one that ends before
// it begins. An empty window writes nothing.
void DequantizeMxfp4(const Mxfp4Matrix& m, OutputWindow w, DType target, WindowOut out);

// Writes window `w` of the transpose [m.cols, *]: rows are stored columns (in), columns stored rows
// (out). REQUIRES: m holds stored rows [w.cols.begin, w.cols.end) from m.first_row on. Throws as
// DequantizeMxfp4, with the roles of rows and columns exchanged. With AVX2, an output of 4 MiB or more
// whose rows start on 64-byte lines is written with non-temporal stores (mxfp4_internal::KernelOptions):
// it is in memory, not in the cache, when the call returns.
void DequantizeMxfp4Transposed(const Mxfp4Matrix& m, OutputWindow w, DType target, WindowOut out);

// --- checks for the stream, each naming the checkpoint key ------------------------------------

std::string Mxfp4BlocksKey(std::string_view param_key);  // "<key>_blocks"
std::string Mxfp4ScalesKey(std::string_view param_key);  // "<key>_scales"

// The model's shape of a blocks tensor [..., rows, cols / 32, 16]: [..., cols, rows]; {} for a
// tensor of fewer than 3 dims or a last dim other than 16.
std::vector<uint64_t> Mxfp4ModelShape(const std::vector<uint64_t>& blocks_shape);

// `key` is the model's. Throws kCheckpoint naming it, both checkpoint keys and all three shapes unless
// blocks is [..., rows, g, 16] (U8), scales [..., rows, g] (U8 or F8_E8M0), and the model's shape is
// Mxfp4ModelShape(blocks); kUnsupported naming the dtypes unless CanDequantizeMxfp4.
void CheckMxfp4Pair(std::string_view key, DType blocks_dtype, const std::vector<uint64_t>& blocks_shape,
                    DType scales_dtype, const std::vector<uint64_t>& scales_shape,
                    const std::vector<uint64_t>& model_shape, DType target);

// --- for tests and benchmarks ----------------------------------------------------------------
namespace mxfp4_internal {

enum class Layout : uint8_t { kStored, kTransposed };

// The transposed AVX2 kernel writes a window whose output (rows x row stride) is at least
// stream_min_bytes with non-temporal stores, 64-byte lines at a time, when its rows start on lines
// alike (a row stride of whole lines, an output aligned to the element): such an output does not stay
// in the cache anyway, and streaming saves reading each line before writing it. Tests lower it to
// run that path on small windows.
struct KernelOptions {
  uint64_t stream_min_bytes = 4ull << 20;  // default 4 MiB
};

// The kernels for `isa` (dequant_internal::SupportedIsas()); kAvx512 runs the AVX2 ones (the work is
// byte shuffles on 16-byte groups, and the bound is memory). kInvalidArgument for one this CPU lacks.
void DequantizeWithIsa(dequant_internal::Isa isa, const Mxfp4Matrix& m, OutputWindow w, DType target,
                       WindowOut out, Layout layout, KernelOptions options = {});

}  // namespace mxfp4_internal
}  // namespace shardcast
