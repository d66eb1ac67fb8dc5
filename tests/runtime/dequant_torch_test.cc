// Dequantize against libtorch's own computation, bit for bit:
//   (w.float() * scale.float().repeat_interleave(bh, 0)[:rows].repeat_interleave(bw, 1)[:, :cols]).to(target)
// with every fp8 byte among the weights and scales that vary per block (NaN, inf, zero, denormal,
// overflowing ones included; and all below 2^8, the range of real checkpoints, where the kernel takes
// another path), over every weight, scale and target dtype.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/version.h>

#include <cstring>
#include <iostream>
#include <set>

#include "loaders/quant/dequant.h"
#include "tests/loaders/dequant_cases.h"

#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 7)
#define SHARDCAST_TORCH_HAS_E8M0 1
#else
#define SHARDCAST_TORCH_HAS_E8M0 0  // torch.float8_e8m0fnu arrived in 2.7
#endif

namespace shardcast {
namespace {

using testing::DequantCase;
using testing::FloatBits;

at::ScalarType TorchType(DType d) {
  switch (d) {
    case DType::kF8_E4M3: return at::kFloat8_e4m3fn;
    case DType::kF8_E5M2: return at::kFloat8_e5m2;
#if SHARDCAST_TORCH_HAS_E8M0
    case DType::kF8_E8M0: return at::kFloat8_e8m0fnu;
#endif
    case DType::kBF16: return at::kBFloat16;
    case DType::kF16: return at::kHalf;
    case DType::kF32: return at::kFloat;
    case DType::kU8: return at::kByte;
    default: ADD_FAILURE() << "no torch type for " << DTypeName(d); return at::kByte;
  }
}

std::vector<DType> ScaleDTypes() {
  std::vector<DType> out;
  for (DType s : testing::kDequantScales) {
    if (s != DType::kF8_E8M0 || SHARDCAST_TORCH_HAS_E8M0) out.push_back(s);
  }
  return out;
}

at::Tensor FromBytes(const std::vector<unsigned char>& bytes, DType d, std::vector<int64_t> shape) {
  at::Tensor raw = at::empty({static_cast<int64_t>(bytes.size())}, at::kByte);
  std::memcpy(raw.data_ptr(), bytes.data(), bytes.size());
  return raw.view(TorchType(d)).view(shape);
}

std::vector<unsigned char> ToBytes(const at::Tensor& t) {
  at::Tensor c = t.contiguous();
  std::vector<unsigned char> out(c.numel() * c.element_size());
  std::memcpy(out.data(), c.data_ptr(), out.size());
  return out;
}

// torch's decoding of the scales to float, as the reference formula does it (scale.float()).
at::Tensor TorchScalesAsFloat(const DequantCase& c) {
  const ScaleGrid g = c.grid();
  at::Tensor s = FromBytes(c.s, c.scale, {static_cast<int64_t>(g.rows), static_cast<int64_t>(g.cols)});
  // uint8 E8M0 bytes the way transformers' Fp8Dequantize reads them: (s.float() - 127).exp2()
  if (c.scale == DType::kU8) return (s.to(at::kFloat) - 127.0).exp2();
  return s.to(at::kFloat);
}

// The reference, given torch's float scales.
std::vector<unsigned char> TorchDequant(const DequantCase& c, const at::Tensor& scale_f32, DType target) {
  const int64_t rows = c.rows, cols = c.cols;
  at::Tensor w = FromBytes(c.w, c.weight, {rows, cols});
  at::Tensor expanded = scale_f32.repeat_interleave(static_cast<int64_t>(c.block.rows), 0)
                            .slice(0, 0, rows)
                            .repeat_interleave(static_cast<int64_t>(c.block.cols), 1)
                            .slice(1, 0, cols);
  return ToBytes((w.to(at::kFloat) * expanded).to(TorchType(target)));
}

// Grid positions whose decoded bits differ between torch and HalfBitsToFloat. The only expected ones:
// F16 NaNs in the scalar tail of torch's F16 -> F32 conversion, which it decodes as 0x7FFFFFFF
// (its vector body gives the quieted payload, as HalfBitsToFloat does). See dequant.h.
std::set<uint64_t> TorchOwnScaleDecoding(const DequantCase& c, const at::Tensor& torch_f32) {
  std::set<uint64_t> out;
  const std::vector<unsigned char> t = ToBytes(torch_f32);
  const size_t ss = DTypeSize(c.scale);
  for (uint64_t i = 0; i < t.size() / 4; ++i) {
    uint32_t torch_bits, ours;
    std::memcpy(&torch_bits, t.data() + 4 * i, 4);
    const unsigned char* p = c.s.data() + i * ss;
    uint16_t h = 0;
    switch (c.scale) {
      case DType::kF32: std::memcpy(&ours, p, 4); break;
      case DType::kBF16: std::memcpy(&h, p, 2); ours = FloatBits(BFloat16BitsToFloat(h)); break;
      case DType::kF16: std::memcpy(&h, p, 2); ours = FloatBits(HalfBitsToFloat(h)); break;
      case DType::kU8: ours = *p == 0xFF ? 0x7F800000u : FloatBits(Fp8E8M0BitsToFloat(*p)); break;  // 2^128 = inf
      default: ours = FloatBits(Fp8E8M0BitsToFloat(*p)); break;
    }
    if (torch_bits == ours) continue;
    EXPECT_TRUE(c.scale == DType::kF16 && (h & 0x7C00) == 0x7C00 && (h & 0x3FF) != 0 && torch_bits == 0x7FFFFFFFu)
        << DTypeName(c.scale) << " scale " << i << ": torch decodes it as 0x" << std::hex << torch_bits
        << ", we as 0x" << ours;
    out.insert(i);
  }
  return out;
}

// Our output against torch's. Where torch decoded an F16 NaN scale by its own tail rule, the elements
// of that block are compared with our kernel run on torch's decoded float scales instead: the
// arithmetic after decoding is still checked bit for bit.
void ExpectMatchesTorch(const DequantCase& c) {
  const at::Tensor scale_f32 = TorchScalesAsFloat(c);
  const std::set<uint64_t> torch_own = TorchOwnScaleDecoding(c, scale_f32);
  DequantCase as_f32 = c;
  as_f32.scale = DType::kF32;
  as_f32.s = ToBytes(scale_f32);
  const uint64_t gc = c.grid().cols;
  for (DType t : testing::kDequantTargets) {
    std::vector<unsigned char> got = c.Run(t);
    const std::vector<unsigned char> want = TorchDequant(c, scale_f32, t);
    if (!torch_own.empty()) {
      const std::vector<unsigned char> got_torch_scales = as_f32.Run(t);
      const size_t es = DTypeSize(t);
      for (uint64_t r = 0; r < c.rows; ++r) {
        for (uint64_t col = 0; col < c.cols; ++col) {
          if (!torch_own.count((r / c.block.rows) * gc + col / c.block.cols)) continue;
          const size_t at = (r * c.cols + col) * es;
          std::memcpy(got.data() + at, got_torch_scales.data() + at, es);
        }
      }
    }
    EXPECT_SAME_BITS(got, want, t, c.Name(t));
  }
}

TEST(DequantTorch, Fp8AndScaleDecodingIsTorchs) {
  std::vector<unsigned char> bytes(256);
  for (int i = 0; i < 256; ++i) bytes[i] = static_cast<unsigned char>(i);
  for (DType d : {DType::kF8_E4M3, DType::kF8_E5M2, DType::kF8_E8M0}) {
    if (d == DType::kF8_E8M0 && !SHARDCAST_TORCH_HAS_E8M0) continue;
    const std::vector<unsigned char> f = ToBytes(FromBytes(bytes, d, {256}).to(at::kFloat));
    for (int i = 0; i < 256; ++i) {
      const uint8_t b = static_cast<uint8_t>(i);
      const float ours = d == DType::kF8_E4M3 ? Fp8E4M3BitsToFloat(b)
                         : d == DType::kF8_E5M2 ? Fp8E5M2BitsToFloat(b)
                                                : Fp8E8M0BitsToFloat(b);
      uint32_t torch_bits;
      std::memcpy(&torch_bits, f.data() + 4 * i, 4);
      EXPECT_EQ(FloatBits(ours), torch_bits) << DTypeName(d) << " byte 0x" << std::hex << i;
    }
  }
  // Every BF16 and F16 bit pattern (65536 elements: all in torch's vector body).
  std::vector<unsigned char> halves(2 * 65536);
  for (uint32_t i = 0; i < 65536; ++i) std::memcpy(halves.data() + 2 * i, &i, 2);
  for (DType d : {DType::kBF16, DType::kF16}) {
    const std::vector<unsigned char> f = ToBytes(FromBytes(halves, d, {65536}).to(at::kFloat));
    for (uint32_t i = 0; i < 65536; ++i) {
      const float ours = d == DType::kBF16 ? BFloat16BitsToFloat(static_cast<uint16_t>(i))
                                           : HalfBitsToFloat(static_cast<uint16_t>(i));
      uint32_t torch_bits;
      std::memcpy(&torch_bits, f.data() + 4 * i, 4);
      ASSERT_EQ(FloatBits(ours), torch_bits) << DTypeName(d) << " 0x" << std::hex << i;
    }
  }
  // The one inconsistency, recorded: a lone F16 NaN goes through torch's scalar path.
  const std::vector<unsigned char> lone = ToBytes(FromBytes({0x01, 0x7C}, DType::kF16, {1}).to(at::kFloat));
  uint32_t lone_bits;
  std::memcpy(&lone_bits, lone.data(), 4);
  std::cout << "torch " << TORCH_VERSION << ": F16 0x7C01 -> F32 0x" << std::hex << lone_bits
            << " alone, 0x" << FloatBits(HalfBitsToFloat(0x7C01)) << " in its vector body" << std::dec << "\n";
}

// The published shapes and odd ones, in 128 x 128 blocks and others, every dtype combination.
TEST(DequantTorch, BitIdenticalToTorchForEveryDTypeCombination) {
  struct Shape {
    uint64_t rows, cols;
    BlockSize block;
  };
  const Shape shapes[] = {{576, 7168, {128, 128}}, {200, 7168, {128, 128}}, {576, 96, {128, 128}},
                          {200, 96, {128, 128}},   {200, 96, {64, 32}},     {200, 300, {7, 5}},
                          {33, 1000, {128, 64}},   {3, 5, {1, 1}}};
  for (const Shape& sh : shapes) {
    for (DType w : testing::kDequantWeights) {
      for (DType s : ScaleDTypes()) {
        for (auto range : {testing::ScaleRange::kWide, testing::ScaleRange::kBelow2To8}) {
          ExpectMatchesTorch(testing::MakeDequantCase(w, s, sh.rows, sh.cols, sh.block,
                                                      static_cast<uint32_t>(sh.rows * 31 + sh.cols), range));
        }
      }
    }
  }
}

// A rank's shard of rows starting and ending mid-block equals torch's slice of the whole.
TEST(DequantTorch, ShardEqualsTorchsSlice) {
  const DequantCase c = testing::MakeDequantCase(DType::kF8_E4M3, DType::kF32, 576, 7168, {128, 128}, 3);
  const std::vector<unsigned char> whole = TorchDequant(c, TorchScalesAsFloat(c), DType::kBF16);
  for (auto [r0, r1] : {std::pair<uint64_t, uint64_t>{100, 300}, {192, 384}, {575, 576}, {0, 1}}) {
    const auto got = c.Run(DType::kBF16, r0, r1, dequant_internal::SupportedIsas().back());
    const std::vector<unsigned char> want(whole.begin() + r0 * c.cols * 2, whole.begin() + r1 * c.cols * 2);
    EXPECT_SAME_BITS(got, want, DType::kBF16, "rows [" + std::to_string(r0) + ", " + std::to_string(r1) + ")");
  }
}

}  // namespace
}  // namespace shardcast
