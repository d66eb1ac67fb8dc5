// loaders/dequant: block-scaled fp8 weights to bf16 / f16 / f32, the pure kernel of fp8 loading.
//
// DeepSeek-V3 and MiniMax-M2 ship linear weights as F8_E4M3 [rows, cols], each with a sidecar
// "<name>.weight_scale_inv" (see ScaleKeyFor) holding one scale per [bh, bw] block of the weight
// (quantization_config.weight_block_size, default 128 x 128). Scale (r, c) belongs to weight rows
// [r*bh, r*bh + bh) and columns [c*bw, c*bw + bw); the last grid row and column also cover the
// partial blocks at the bottom and right edges:
//
//            cols = 300, bw = 128                       scale grid, ScaleGridFor(200, 300, b)
//          |<- 128 ->|<- 128 ->|<-44->|                 = [ceil(200/128), ceil(300/128)] = [2, 3]
//   0    - +---------+---------+------+
//          | s[0][0] | s[0][1] |s[0][2]|   rows [0, 128)
//   128  - +---------+---------+------+
//          | s[1][0] | s[1][1] |s[1][2]|   rows [128, 200): a partial block row
//   200  - +---------+---------+------+
//
// The rule, per element, bit-identical to torch's CPU result of
//   (w.float() * scale.float().repeat_interleave(bh, 0)[:rows].repeat_interleave(bw, 1)[:, :cols]).to(target):
//   out[r][c] = round_to_nearest_even<target>(float(w[r][c]) * float(scale[r / bh][c / bw]))
// One fp32 product (no FMA, no fast-math, denormals kept), then one rounding to the target.
// NaNs carry the bits torch's CPU kernels give them (they are not IEEE's only answer):
//   - fp8 and scale decoding: Fp8E4M3BitsToFloat and friends in dtype.h, HalfBitsToFloat,
//     BFloat16BitsToFloat; an F32 scale as stored;
//   - a NaN scale makes its whole block quiet(scale) even where the weight is NaN too (torch's
//     product keeps the second operand's payload); a NaN weight times a number is quiet(weight);
//     inf * 0 is the hardware's default NaN (0xFFC00000 on x86), as in torch;
//   - to BF16 every NaN becomes 0xFFFF; to F16 sign | 0x7E00 | the payload's top 10 bits (what
//     F16C's vcvtps2ph gives); to F32 the product's bits.
// One known difference: torch's own F16 -> F32 conversion is not consistent for NaN. Its vector
// body gives the quieted payload (HalfBitsToFloat's answer, used here), while its scalar tail (the
// last numel % 8 elements of the scale tensor on x86) gives 0x7FFFFFFF. So for an F16 *NaN scale*
// and an F16 or F32 target, torch's bits depend on where the scale sits in its grid; this kernel
// always gives the vector body's. Real checkpoints carry no NaN scales.
// Bit-identity holds in the default floating-point environment, the one torch runs in. Under DAZ
// (torch.set_flush_denormal(True)) fp8 subnormal weights are still decoded exactly; denormal scales
// and products are then flushed by the same hardware multiply torch uses.
//
// Loading rule for callers (the stream): an fp8 weight is dequantized only with its scale. An fp8
// tensor without a scale sidecar is never raw-cast to a wider type (ConvertElements refuses it too):
// it is either loaded as fp8 bytes unchanged or it is an error naming the key.
//
// Types: weights F8_E4M3 (e4m3fn) or F8_E5M2; scales F32, BF16, F16, F8_E8M0 or U8; targets BF16,
// F16 or F32. Anything else is kUnsupported naming the dtypes.
// E8M0 scales ("scale_fmt": "ue8m0") come two ways. F8_E8M0 tensors decode as torch's
// float8_e8m0fnu does (0xFF is NaN). U8 tensors (MXFP8 checkpoints store the exponent bytes as
// uint8) decode as transformers reads them, (float(b) - 127).exp2(): exactly 2^(b - 127), and 255 is
// 2^128 = inf, not NaN.
// Thread safety: pure functions. Dequantize is single-threaded; callers parallelize by splitting
// rows, and any split gives the same bytes as one call over all rows.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "loaders/dtype.h"
#include "loaders/quant/block_size.h"

namespace shardcast {

struct ScaleGrid {
  uint64_t rows = 0, cols = 0;
};

// Half-open [begin, end) rows of a weight or of its scale grid.
struct RowSpan {
  uint64_t begin = 0, end = 0;
  uint64_t size() const { return end - begin; }
};

// The fp8 bytes of weight rows [rows.begin, rows.end), row-major, `cols` per row. No alignment needed.
struct DequantSource {
  DType dtype = DType::kF8_E4M3;
  const void* data = nullptr;
};

// Scale rows ScaleRowsFor(rows, block) of the grid, row-major, `grid_cols` elements per row. Only
// the first ceil(cols / block.cols) of each row are read. No alignment needed.
struct DequantScale {
  DType dtype = DType::kF32;
  const void* data = nullptr;
  uint64_t grid_cols = 0;
};

// {ceil(rows / b.rows), ceil(cols / b.cols)}. REQUIRES: b.rows, b.cols > 0.
ScaleGrid ScaleGridFor(uint64_t rows, uint64_t cols, BlockSize block);

// The scale grid rows weight rows [rows.begin, rows.end) need: [begin / bh, ceil(end / bh)),
// empty for an empty span. Worked examples with bh = 128:
//   rows [0, 128)   -> grid rows [0, 1)
//   rows [100, 300) -> grid rows [0, 3)    (a shard starting mid-block needs its block's scale row)
//   rows [128, 129) -> grid rows [1, 2)
RowSpan ScaleRowsFor(RowSpan rows, BlockSize block);

bool CanDequantize(DType weight, DType scale, DType target);

// Dequantizes weight rows [rows.begin, rows.end) of a block-quantized [*, cols] weight into `out`
// ((rows.end - rows.begin) * cols elements of `target`, row-major, no alignment needed). rows.begin
// need not be on a block boundary. An empty span or cols == 0 writes nothing.
// Allocates cols floats of scratch (one block row's scales, expanded) per call, nothing else.
// REQUIRES: the source and scale buffers hold what their structs say; out does not overlap them.
// Throws: kUnsupported (naming the three dtypes) unless CanDequantize; kInvalidArgument for a zero
// block size, rows.end < rows.begin, or grid_cols < ceil(cols / block.cols).
void Dequantize(const DequantSource& weight, const DequantScale& scale, RowSpan rows, uint64_t cols,
                BlockSize block, DType target, void* out);

// --- checks for the stream, each naming the checkpoint key ------------------------------------

// "<weight_key>_scale_inv": "model.layers.0.mlp.up_proj.weight" -> "...up_proj.weight_scale_inv".
std::string ScaleKeyFor(std::string_view weight_key);

// Throws kUnsupported naming `key` and the three dtypes unless CanDequantize(weight, scale, target).
void CheckDequantizable(std::string_view key, DType weight, DType scale, DType target);

// `key` is the weight's. Throws kCheckpoint naming it, its scale key, both shapes and the block size
// unless the weight is 2-D and the scale is exactly ScaleGridFor(weight, block): a smaller grid leaves
// blocks without a scale, a larger one means the checkpoint was quantized with another block size
// than the config declares. kInvalidArgument for a block size with a zero side.
void CheckScaleShape(std::string_view key, const std::vector<uint64_t>& weight_shape,
                     const std::vector<uint64_t>& scale_shape, BlockSize block);

// --- for tests and benchmarks ----------------------------------------------------------------
namespace dequant_internal {

// The instruction sets the row kernels are compiled for. Every one gives the same bits; Dequantize
// uses the best this CPU (and its OS) supports, detected once.
enum class Isa : uint8_t { kBaseline, kAvx2, kAvx512 };
std::string_view IsaName(Isa isa);
std::vector<Isa> SupportedIsas();  // on this CPU, kBaseline first, best last
Isa BestIsa();                      // SupportedIsas().back(), detected once (every kernel's dispatch)

// Dequantize with the kernels of `isa`; kInvalidArgument for one not in SupportedIsas().
void DequantizeWithIsa(Isa isa, const DequantSource& weight, const DequantScale& scale, RowSpan rows,
                       uint64_t cols, BlockSize block, DType target, void* out);

}  // namespace dequant_internal
}  // namespace shardcast
