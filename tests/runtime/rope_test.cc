// RoPE inv_freq for every type, against references computed here from the published formulas in long
// double and rounded once: every value within 1 ulp of float32.
#include "runtime/materialize/rope.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <nlohmann/json.hpp>

#include "tests/loaders/test_util.h"

namespace shardcast {
namespace {

using LD = long double;

int64_t UlpDistance(float a, float b) {
  int32_t ia, ib;
  std::memcpy(&ia, &a, 4);
  std::memcpy(&ib, &b, 4);
  if (ia < 0) ia = INT32_MIN - ia;
  if (ib < 0) ib = INT32_MIN - ib;
  return std::llabs(static_cast<int64_t>(ia) - ib);
}

void ExpectWithin1Ulp(const std::vector<float>& got, const std::vector<LD>& want) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i) {
    EXPECT_LE(UlpDistance(got[i], static_cast<float>(want[i])), 1)
        << "i=" << i << " got " << got[i] << " want " << static_cast<double>(want[i]);
  }
}

std::vector<LD> Base(LD theta, size_t dim) {
  std::vector<LD> v(dim / 2);
  for (size_t i = 0; i < v.size(); ++i) v[i] = 1.0L / std::pow(theta, LD(2 * i) / LD(dim));
  return v;
}

TEST(Rope, Default) {
  auto cfg = nlohmann::json::parse(R"({"rope_theta": 1000000.0, "max_position_embeddings": 40960})");
  RopeInit r = ComputeRope(cfg, "c", 128);
  EXPECT_EQ(r.rope_type, "default");
  EXPECT_EQ(r.attention_scaling, 1.0);
  ExpectWithin1Ulp(r.inv_freq, Base(1000000, 128));
}

TEST(Rope, PartialRotaryUsesTheRotaryDim) {  // MiniMax-M2: rotary_dim 64 of head_dim 128
  auto cfg = nlohmann::json::parse(R"({"rope_theta": 5000000, "head_dim": 128, "rotary_dim": 64})");
  RopeInit r = ComputeRope(cfg, "c", 64);
  ASSERT_EQ(r.inv_freq.size(), 32u);
  ExpectWithin1Ulp(r.inv_freq, Base(5000000, 64));
}

TEST(Rope, Linear) {
  auto cfg = nlohmann::json::parse(R"({"rope_theta": 10000, "rope_scaling": {"type": "linear", "factor": 4.0}})");
  std::vector<LD> want = Base(10000, 64);
  for (LD& v : want) v /= 4;
  ExpectWithin1Ulp(ComputeRope(cfg, "c", 64).inv_freq, want);
}

TEST(Rope, DynamicAtInitIsDefault) {
  auto cfg = nlohmann::json::parse(
      R"({"rope_theta": 10000, "max_position_embeddings": 4096, "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}})");
  ExpectWithin1Ulp(ComputeRope(cfg, "c", 64).inv_freq, Base(10000, 64));
}

// Llama-3.1-8B's published parameters. In the medium band the published implementation smooths in
// float32, which lands up to 3 ulp from the exact value (cancellation in 1 - smooth); the model
// computes exactly that, so there the reference is the published formula evaluated in float32, op by
// op. Elsewhere the reference is exact.
TEST(Rope, Llama3) {
  auto cfg = nlohmann::json::parse(R"({"rope_theta": 500000.0, "rope_scaling": {"rope_type": "llama3", "factor": 8.0,
      "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}})");
  std::vector<LD> want = Base(500000, 128);
  const LD factor = 8, low = 1, high = 4, old = 8192;
  for (size_t i = 0; i < want.size(); ++i) {
    LD& f = want[i];
    LD wavelen = 2 * M_PIl / f;
    if (wavelen < old / high) continue;                      // high frequency: unchanged
    if (wavelen > old / low) { f /= factor; continue; }      // low frequency: divided by factor
    float f32 = 1.0f / std::pow(500000.0f, static_cast<float>(2 * i) / 128.0f);  // in between: float32
    float wl = (1.0f / f32) * static_cast<float>(2 * M_PI);
    float smooth = ((1.0f / wl) * 8192.0f - 1.0f) / 3.0f;
    f = (1.0f - smooth) * f32 / 8.0f + smooth * f32;
  }
  RopeInit r = ComputeRope(cfg, "c", 128);
  EXPECT_EQ(r.rope_type, "llama3");
  ExpectWithin1Ulp(r.inv_freq, want);
}

// DeepSeek-V3's published YaRN parameters over its MLA rope dim (qk_rope_head_dim 64).
TEST(Rope, YarnWithAttentionScaling) {
  auto cfg = nlohmann::json::parse(R"({"rope_theta": 10000, "max_position_embeddings": 163840,
      "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
                       "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}})");
  const LD dim = 64, base = 10000, factor = 40, orig = 4096;
  auto corr = [&](LD rot) { return dim * std::log(orig / (rot * 2 * M_PIl)) / (2 * std::log(base)); };
  LD low = std::max<LD>(std::floor(corr(32)), 0), high = std::min<LD>(std::ceil(corr(1)), dim - 1);
  std::vector<LD> want(32);
  for (size_t i = 0; i < want.size(); ++i) {
    LD pos = std::pow(base, LD(2 * i) / dim);
    LD ramp = std::min<LD>(1, std::max<LD>(0, (LD(i) - low) / (high - low)));
    LD extrapolation_factor = 1 - ramp;
    want[i] = (1 / (factor * pos)) * (1 - extrapolation_factor) + (1 / pos) * extrapolation_factor;
  }
  RopeInit r = ComputeRope(cfg, "c", 64);
  EXPECT_EQ(r.rope_type, "yarn");
  ExpectWithin1Ulp(r.inv_freq, want);
  EXPECT_DOUBLE_EQ(r.attention_scaling, 1.0);  // mscale == mscale_all_dim: the ratio is 1
  cfg["rope_scaling"].erase("mscale_all_dim");
  EXPECT_NEAR(ComputeRope(cfg, "c", 64).attention_scaling, 0.1 * std::log(40.0) + 1.0, 1e-12);
}

TEST(Rope, TransformersFiveRopeParametersLayout) {
  auto cfg = nlohmann::json::parse(R"({"rope_parameters": {"rope_type": "default", "rope_theta": 250000.0}})");
  ExpectWithin1Ulp(ComputeRope(cfg, "c", 32).inv_freq, Base(250000, 32));
}

// LongRoPE at init (no sequence yet): the short factors, 1 / (short[i] * theta^(2i / dim)); Phi-3's "su" (and
// "yarn") name it there. A list of another length than dim / 2 is a ConfigError.
TEST(Rope, LongRopeTakesTheShortFactorsAtInit) {
  auto cfg = nlohmann::json::parse(R"({"model_type": "phi3", "rope_theta": 10000.0, "max_position_embeddings": 131072,
      "original_max_position_embeddings": 4096,
      "rope_scaling": {"type": "longrope", "short_factor": [1.0, 1.05, 1.5, 2.0], "long_factor": [1, 2, 3, 4]}})");
  std::vector<LD> want = Base(10000, 8);
  const LD shortf[] = {1.0L, 1.05L, 1.5L, 2.0L};
  for (size_t i = 0; i < want.size(); ++i) want[i] /= static_cast<LD>(static_cast<float>(shortf[i]));
  const RopeInit r = ComputeRope(cfg, "c", 8);
  ExpectWithin1Ulp(r.inv_freq, want);
  EXPECT_NEAR(r.attention_scaling, std::sqrt(1 + std::log(32.0) / std::log(4096.0)), 1e-12);
  cfg["rope_scaling"]["type"] = "su";
  ExpectWithin1Ulp(ComputeRope(cfg, "c", 8).inv_freq, want);
  EXPECT_SC_ERROR(ComputeRope(cfg, "c.json", 16), ErrorKind::kConfig, "c.json", "short_factor has 4 numbers",
                  "needs 8");
}

TEST(Rope, UnknownTypeOrMissingFieldIsAConfigError) {
  auto cfg = nlohmann::json::parse(R"({"rope_scaling": {"rope_type": "su"}})");
  EXPECT_SC_ERROR(ComputeRope(cfg, "c.json", 64), ErrorKind::kConfig, "c.json", "rope type \"su\" has no init rule",
                  "llama3");
  auto missing = nlohmann::json::parse(R"({"rope_scaling": {"rope_type": "llama3", "factor": 8}})");
  EXPECT_SC_ERROR(ComputeRope(missing, "c.json", 64), ErrorKind::kConfig, "low_freq_factor");
}

}  // namespace
}  // namespace shardcast
