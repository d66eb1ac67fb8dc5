#include "loaders/synth.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>

#include "loaders/checkpoint.h"
#include "tests/loaders/test_util.h"

namespace shardcast {
namespace {

constexpr const char* kTinyMoe = R"({"model_type":"qwen3_moe","num_hidden_layers":3,"hidden_size":64,
  "num_attention_heads":4,"num_key_value_heads":2,"head_dim":16,"intermediate_size":96,"moe_intermediate_size":32,
  "num_experts":4,"vocab_size":100,"torch_dtype":"bfloat16"})";

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
  std::vector<unsigned char> e4m3(4096);
  SynthElements(1, "q", DType::kF8_E4M3, 0, e4m3.size(), e4m3.data());
  for (unsigned char c : e4m3) ASSERT_NE(c & 0x7F, 0x7F) << "E4M3 NaN";
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

}  // namespace
}  // namespace shardcast
