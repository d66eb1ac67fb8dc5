// loaders/nvfp4: NVFP4 weights (NVIDIA ModelOpt's "quant_algo": "NVFP4") to bf16 / f16 / f32, the pure
// kernel of NVFP4 loading.
//
// A ModelOpt NVFP4 linear "<m>" is stored as
//   "<m>.weight"          U8 [out, in / 2]      two E2M1 values a byte, the low nibble first
//   "<m>.weight_scale"    F8_E4M3 [out, in / 16] one scale per 16 consecutive values of a row
//   "<m>.weight_scale_2"  F32 [] or [1]          one global scale for the tensor
// The model's weight is [out, in], the stored layout (no transpose).
//
// The rule, per element, as ModelOpt's NVFP4QTensor.dequantize and vLLM's reference compute it in
// float32 (block scale times global scale first, one rounding; then the value times that, one
// rounding; then one rounding to the target):
//   s[r][b]  = fl32(float(weight_scale[r][b]) * global)
//   out[r][c] = round_to_nearest_even<target>(fl32(E2M1(nibble(r, c)) * s[r][c / 16]))
//   E2M1 = {0, .5, 1, 1.5, 2, 3, 4, 6, -0, -.5, -1, -1.5, -2, -3, -4, -6}[nibble]
// transformers has no CPU dequantization of NVFP4 (5.23's "nvfp4" quantizer packs bf16 weights for a
// GPU kernel and refuses pre-quantized checkpoints), so tests compare with this rule written out
// independently (tests/python/nvfp4_worker.py's reference, in torch) and with hand-computed blocks.
// Code 8 is -0.0, as the OCP format, vLLM's reference and the hardware have it; ModelOpt's Python
// table writes +0.0 there, so its dequantize differs from this one in the sign of those zeros only.
// A NaN scale (E4M3 0x7F / 0xFF) gives NaN, as dtype.h's conversions write it.
//
// Window: rows [r0, r1) x columns [c0, c1) of [out, in], row-major at `out` (rows of `row_stride`
// elements, 0: the window's width). It reads stored rows [r0, r1) (from `first_row` on) and their
// scale blocks [c0 / 16, ceil(c1 / 16)).
//
// Thread safety: pure functions; single-threaded, any split of a window gives the same bytes. Each
// thread keeps the lookup tables of the last few (global scale, target) pairs it used.
#pragma once

#include <cstdint>
#include <string_view>
#include <vector>

#include "loaders/dtype.h"
#include "loaders/quant/mxfp4.h"

namespace shardcast {

inline constexpr uint64_t kNvfp4Block = 16;  // values per E4M3 scale

struct Nvfp4Matrix {
  const uint8_t* values = nullptr;  // stored rows from first_row on, cols / 2 bytes each
  const uint8_t* scales = nullptr;  // the same rows' F8_E4M3 scales, cols / 16 bytes each
  float global_scale = 1.0f;        // weight_scale_2
  uint64_t first_row = 0;           // default 0: the stored row `values` and `scales` begin at
  uint64_t cols = 0;                // values per row (in); a multiple of 16
};

// Writes window `w` of [*, m.cols]. Throws kUnsupported for a target other than BF16, F16 or F32;
// kInvalidArgument for cols not a multiple of 16 or a window outside what m holds.
void DequantizeNvfp4(const Nvfp4Matrix& m, OutputWindow w, DType target, WindowOut out);

namespace nvfp4_internal {

// The kernels for `isa` (dequant_internal::SupportedIsas()): kBaseline looks every value up in its
// scale's table (two values a byte for 16-bit targets); kAvx2 and kAvx512 shuffle a whole block in
// registers for 16-bit targets. kInvalidArgument for an ISA this CPU lacks.
void DequantizeWithIsa(dequant_internal::Isa isa, const Nvfp4Matrix& m, OutputWindow w, DType target, WindowOut out);

// How many times this thread has built a (global scale, target) key's tables. A call reuses the tables
// of the last 4 keys the thread used (any ISA), so repeated windows of one tensor build them once.
uint64_t TablesBuilt();

}  // namespace nvfp4_internal

// `key` is the weight's. Throws kCheckpoint naming the three keys and shapes unless the weight is U8
// [out, in / 2], the scale F8_E4M3 [out, in / 16] and the global scale one F32 element.
void CheckNvfp4Triple(std::string_view key, DType weight, const std::vector<uint64_t>& weight_shape, DType scale,
                      const std::vector<uint64_t>& scale_shape, DType global, const std::vector<uint64_t>& global_shape);

}  // namespace shardcast
