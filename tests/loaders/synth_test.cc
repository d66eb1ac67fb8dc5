#include "loaders/synth.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <set>

#include "loaders/checkpoint.h"
#include "loaders/quant/dequant.h"
#include "tests/loaders/test_util.h"

namespace shardcast {
namespace {

constexpr const char* kTinyMoe = R"({"model_type":"qwen3_moe","num_hidden_layers":3,"hidden_size":64,
  "num_attention_heads":4,"num_key_value_heads":2,"head_dim":16,"intermediate_size":96,"moe_intermediate_size":32,
  "num_experts":4,"vocab_size":100,"torch_dtype":"bfloat16"})";

// DeepSeek-V3's layout, shrunk, with dimensions that leave partial blocks of 64 x 32 at both edges.
constexpr const char* kTinyFp8 = R"({"model_type":"deepseek_v3","hidden_size":80,"intermediate_size":200,
  "moe_intermediate_size":48,"num_hidden_layers":2,"first_k_dense_replace":1,"moe_layer_freq":1,
  "num_attention_heads":2,"num_key_value_heads":2,"q_lora_rank":40,"kv_lora_rank":24,"qk_nope_head_dim":16,
  "qk_rope_head_dim":8,"v_head_dim":16,"n_routed_experts":3,"n_shared_experts":1,"num_experts_per_tok":2,
  "vocab_size":50,"rope_theta":10000,"tie_word_embeddings":false,"torch_dtype":"bfloat16",
  "quantization_config":{"quant_method":"fp8","fmt":"e4m3","activation_scheme":"dynamic","weight_block_size":[64,32]}})";

float E4M3(uint8_t b) { return Fp8E4M3BitsToFloat(b); }

std::vector<unsigned char> ReadEntry(const Checkpoint& ckpt, const std::string& key) {
  const Checkpoint::Entry* ce = ckpt.Find(key);
  if (ce == nullptr) return {};
  std::vector<unsigned char> data(ce->info->nbytes());
  ce->file->ReadRows(*ce->info, 0, ce->info->rows(), data.data());
  return data;
}

TEST(Synth, ValuesAreDeterministicFiniteAndSmall) {
  std::vector<uint16_t> a(1000), b(1000);
  SynthElements(7, "k", DType::kBF16, 0, 1000, a.data());
  SynthElements(7, "k", DType::kBF16, 500, 500, b.data() + 500);  // any slice gives the same values
  EXPECT_EQ(std::memcmp(a.data() + 500, b.data() + 500, 1000), 0);
  SynthElements(8, "k", DType::kBF16, 0, 1000, b.data());
  EXPECT_NE(a, b);
  for (uint16_t h : a) {
    float f = BFloat16BitsToFloat(h);
    ASSERT_TRUE(std::isfinite(f));
    ASSERT_GE(std::fabs(f), 1.0f / 128);
    ASSERT_LT(std::fabs(f), 1.0f);
  }
  for (DType d : {DType::kF16, DType::kF32}) {
    std::vector<unsigned char> raw(4 * 1000);
    SynthElements(1, "x", d, 0, 1000, raw.data());
    std::vector<float> f(1000);
    ConvertElements(d, DType::kF32, raw.data(), f.data(), 1000);
    for (float x : f) ASSERT_TRUE(std::isfinite(x) && std::fabs(x) < 1.0f && x != 0.0f);
  }
}

// fp8 weights look block-quantized: spread over the whole format, extremes at its largest value,
// bell-shaped (the sum of four uniforms: standard deviation max / sqrt(3)), never NaN or inf.
TEST(Synth, Fp8WeightsLookQuantized) {
  constexpr size_t kN = 1 << 18;
  std::vector<unsigned char> q(kN);
  SynthElements(1, "model.layers.0.mlp.up_proj.weight", DType::kF8_E4M3, 0, kN, q.data());
  double sum = 0, sq = 0, largest = 0;
  std::set<uint8_t> codes;
  size_t below_one = 0, subnormal_or_zero = 0;
  for (unsigned char c : q) {
    ASSERT_NE(c & 0x7F, 0x7F) << "E4M3 NaN";
    const double x = E4M3(c);
    sum += x;
    sq += x * x;
    largest = std::max(largest, std::fabs(x));
    codes.insert(c);
    below_one += std::fabs(x) < 1;
    subnormal_or_zero += (c & 0x78) == 0;
  }
  EXPECT_LT(std::fabs(sum / kN), 2.0);
  EXPECT_NEAR(std::sqrt(sq / kN), 448 / std::sqrt(12.0), 5.0);
  EXPECT_GE(largest, 320);
  EXPECT_GT(codes.size(), 200u);  // most of the 254 finite codes
  EXPECT_GT(below_one, 0u);
  EXPECT_GT(subnormal_or_zero, 0u);
  std::vector<unsigned char> e5(kN);
  SynthElements(1, "w", DType::kF8_E5M2, 0, kN, e5.data());
  double sq5 = 0;
  for (unsigned char c : e5) {
    const float x = Fp8E5M2BitsToFloat(c);
    ASSERT_TRUE(std::isfinite(x)) << std::hex << int(c);
    sq5 += double(x) * x;
  }
  EXPECT_NEAR(std::sqrt(sq5 / kN), 57344 / std::sqrt(12.0), 600);
}

// Scales ("<weight>_scale_inv") are positive, log-uniform by binade in [2^-14, 2^-6), one per block.
TEST(Synth, ScalesVaryPerBlock) {
  for (DType d : {DType::kF32, DType::kBF16, DType::kF16, DType::kF8_E8M0}) {
    constexpr size_t kN = 4096;
    std::vector<unsigned char> raw(kN * DTypeSize(d));
    SynthElements(3, "model.layers.0.mlp.up_proj.weight_scale_inv", d, 0, kN, raw.data());
    std::set<float> values;
    std::set<int> binades;
    for (size_t i = 0; i < kN; ++i) {
      const unsigned char* p = raw.data() + i * DTypeSize(d);
      uint16_t h;
      float s;
      switch (d) {
        case DType::kF32: std::memcpy(&s, p, 4); break;
        case DType::kBF16: std::memcpy(&h, p, 2); s = BFloat16BitsToFloat(h); break;
        case DType::kF16: std::memcpy(&h, p, 2); s = HalfBitsToFloat(h); break;
        default: s = Fp8E8M0BitsToFloat(*p);
      }
      ASSERT_GE(s, std::ldexp(1.0f, -14)) << DTypeName(d);
      ASSERT_LT(s, std::ldexp(1.0f, -6)) << DTypeName(d);
      values.insert(s);
      binades.insert(std::ilogb(s));
    }
    EXPECT_EQ(binades.size(), 8u) << DTypeName(d);
    EXPECT_GT(values.size(), d == DType::kF8_E8M0 ? 7u : 1000u) << DTypeName(d);
  }
}

TEST(Synth, CheckpointReadsBackAndVerifiesEveryByte) {
  testing::TempDir dir;
  ModelSpec spec = BuildModelSpecFromJson("tiny.json", kTinyMoe);
  SynthOptions opt;
  opt.seed = 42;
  opt.max_shard_bytes = 40000;
  WrittenCheckpoint w = WriteSynthCheckpoint(spec, dir.path(), opt);
  EXPECT_GT(w.files.size(), 2u);
  auto ckpt = Checkpoint::Open(dir.path());
  size_t checked = 0;
  for (const auto& e : spec.entries) {
    const Checkpoint::Entry* ce = ckpt->Find(e.key);
    if (e.role == Role::kNonPersistentBuffer) {
      EXPECT_EQ(ce, nullptr) << e.key;
      continue;
    }
    ASSERT_NE(ce, nullptr) << e.key;
    EXPECT_EQ(ce->info->shape, e.shape);
    std::vector<unsigned char> data(ce->info->nbytes());
    ce->file->ReadRows(*ce->info, 0, ce->info->rows(), data.data());
    EXPECT_EQ(SynthFirstMismatch(42, e.key, e.dtype, 0, e.numel(), data.data()), UINT64_MAX) << e.key;
    EXPECT_NE(SynthFirstMismatch(43, e.key, e.dtype, 0, e.numel(), data.data()), UINT64_MAX) << e.key;
    ++checked;
  }
  EXPECT_EQ(checked, ckpt->keys().size());
}

// The bf16 twin is the fp8 checkpoint already dequantized: the same keys but the scales, BF16 where
// a weight was fp8 and its bytes Dequantize's, every other entry byte for byte the same; its config
// builds its spec.
TEST(Synth, Bf16TwinHoldsTheDequantizedFp8Checkpoint) {
  ModelSpec spec = BuildModelSpecFromJson("tiny-fp8.json", kTinyFp8);
  const Bf16Twin twin = MakeBf16Twin(spec);
  ASSERT_GT(twin.dequantized.size(), 5u);
  EXPECT_EQ(twin.dequantized[0].block.rows, 64u);
  EXPECT_EQ(twin.dequantized[0].block.cols, 32u);
  const ModelSpec rebuilt = BuildModelSpecFromJson("twin.json", twin.spec.config_json);
  ASSERT_EQ(rebuilt.entries.size(), twin.spec.entries.size());
  for (size_t i = 0; i < rebuilt.entries.size(); ++i) {
    EXPECT_EQ(rebuilt.entries[i].key, twin.spec.entries[i].key);
    EXPECT_EQ(rebuilt.entries[i].dtype, twin.spec.entries[i].dtype) << rebuilt.entries[i].key;
    EXPECT_EQ(rebuilt.entries[i].shape, twin.spec.entries[i].shape) << rebuilt.entries[i].key;
  }

  testing::TempDir dir;
  SynthOptions opt;
  opt.seed = 9;
  opt.max_shard_bytes = 30000;  // several files: entries split from their scales
  WriteSynthCheckpoint(spec, dir / "fp8", opt);
  opt.bf16_twin = true;
  WriteSynthCheckpoint(spec, dir / "bf16", opt);
  auto fp8 = Checkpoint::Open(dir / "fp8");
  auto bf16 = Checkpoint::Open(dir / "bf16");
  size_t dequantized = 0, same = 0;
  for (const auto& e : spec.entries) {
    if (e.role == Role::kNonPersistentBuffer) continue;
    const std::vector<unsigned char> a = ReadEntry(*fp8, e.key), b = ReadEntry(*bf16, e.key);
    ASSERT_FALSE(a.empty()) << e.key;
    if (e.role == Role::kSidecar) {
      EXPECT_TRUE(b.empty()) << e.key << " is in the twin";
      continue;
    }
    ASSERT_FALSE(b.empty()) << e.key;
    if (e.dtype != DType::kF8_E4M3) {
      EXPECT_EQ(a, b) << e.key;
      ++same;
      continue;
    }
    EXPECT_EQ(bf16->Find(e.key)->info->dtype, DType::kBF16);
    const std::vector<unsigned char> s = ReadEntry(*fp8, ScaleKeyFor(e.key));
    const uint64_t rows = e.shape[0], cols = e.shape[1];
    std::vector<unsigned char> want(rows * cols * 2);
    Dequantize({DType::kF8_E4M3, a.data()}, {DType::kF32, s.data(), ScaleGridFor(rows, cols, {64, 32}).cols},
               {0, rows}, cols, {64, 32}, DType::kBF16, want.data());
    EXPECT_EQ(b, want) << e.key;
    // And any slice of it, as a verifier of a rank's rows would ask.
    const SynthQuantizedWeight* q = nullptr;
    for (const auto& d : twin.dequantized) q = d.key == e.key ? &d : q;
    ASSERT_NE(q, nullptr);
    std::vector<unsigned char> part(2 * 77);
    SynthDequantizedElements(9, *q, DType::kBF16, cols + 5, 77, part.data());
    EXPECT_EQ(std::memcmp(part.data(), want.data() + 2 * (cols + 5), part.size()), 0) << e.key;
    ++dequantized;
  }
  EXPECT_EQ(dequantized, twin.dequantized.size());
  EXPECT_GT(same, 5u);
  EXPECT_EQ(bf16->keys().size(), fp8->keys().size() - twin.dequantized.size());
}

TEST(Synth, SparseFp8AndTwinAreHoles) {
  testing::TempDir dir;
  ModelSpec spec = BuildModelSpecFromJson("tiny-fp8.json", kTinyFp8);
  SynthOptions opt;
  opt.sparse = true;
  WrittenCheckpoint a = WriteSynthCheckpoint(spec, dir / "fp8", opt);
  opt.bf16_twin = true;
  WrittenCheckpoint b = WriteSynthCheckpoint(spec, dir / "bf16", opt);
  uint64_t fp8_bytes = 0, twin_bytes = 0;
  for (const auto& e : CheckpointEntries(spec)) fp8_bytes += e.nbytes();
  for (const auto& e : CheckpointEntries(MakeBf16Twin(spec).spec)) twin_bytes += e.nbytes();
  EXPECT_EQ(a.total_bytes, fp8_bytes);
  EXPECT_EQ(b.total_bytes, twin_bytes);
  EXPECT_GT(twin_bytes, fp8_bytes);  // the weights doubled, the scales gone
  auto ckpt = Checkpoint::Open(dir / "bf16");
  const std::vector<unsigned char> w = ReadEntry(*ckpt, "model.layers.0.mlp.up_proj.weight");
  ASSERT_FALSE(w.empty());
  EXPECT_EQ(w, std::vector<unsigned char>(w.size(), 0));
}

}  // namespace
}  // namespace shardcast
