// Multi-process loads over real c10d Gloo: every rank is this binary re-executed as a worker
// (load_worker.cc). Bit-exact shards for world sizes 1-4 and both sources; every mismatch becomes the
// same error on every rank within the timeout; nothing hangs, even when a rank is killed.
#include <gtest/gtest.h>
#include <signal.h>

#include <chrono>
#include <nlohmann/json.hpp>
#include <set>

#include "loaders/synth.h"
#include "runtime/subprocess.h"
#include "tests/loaders/test_util.h"
#include "tests/runtime/load_worker.h"

namespace shardcast {
namespace {

constexpr uint64_t kSeed = 7;

const char* kQwen = R"({"model_type":"qwen3_moe","num_hidden_layers":2,"hidden_size":48,"num_attention_heads":4,
  "num_key_value_heads":2,"head_dim":12,"intermediate_size":40,"moe_intermediate_size":20,"num_experts":5,
  "vocab_size":13,"mlp_only_layers":[0],"torch_dtype":"bfloat16","rope_theta":10000})";
const char* kDeepseekFp8 = R"({"model_type":"deepseek_v3","num_hidden_layers":2,"hidden_size":136,
  "intermediate_size":72,"moe_intermediate_size":24,"num_attention_heads":2,"q_lora_rank":40,"kv_lora_rank":24,
  "qk_nope_head_dim":8,"qk_rope_head_dim":8,"v_head_dim":8,"n_routed_experts":3,"n_shared_experts":1,
  "first_k_dense_replace":1,"vocab_size":11,"max_position_embeddings":512,"torch_dtype":"bfloat16",
  "rope_scaling":{"type":"yarn","factor":4,"original_max_position_embeddings":128},
  "quantization_config":{"quant_method":"fp8","weight_block_size":[128,128]}})";
const char* kLlamaF32 = R"({"model_type":"llama","num_hidden_layers":1,"hidden_size":32,"num_attention_heads":2,
  "intermediate_size":24,"vocab_size":9,"torch_dtype":"float32"})";
const char* kSlow = R"({"model_type":"qwen3_moe","num_hidden_layers":2,"hidden_size":256,"num_attention_heads":4,
  "num_key_value_heads":2,"head_dim":64,"intermediate_size":512,"moe_intermediate_size":256,"num_experts":8,
  "vocab_size":1001,"torch_dtype":"bfloat16"})";

struct Result {
  bool ok = false;
  std::string kind, message;
  int64_t checked = 0, mismatches = 0, skipped = 0, verified = 0;
  bool reported = false;
};

class LoadTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new testing::TempDir();
    Write("qwen", kQwen, {});
    Write("deepseek", kDeepseekFp8, {});
    Write("llama_f32", kLlamaF32, {});
    Write("slow", kSlow, {});
    Write("missing", kQwen, [](ModelSpec& s) {
      for (size_t i = 0; i < s.entries.size(); ++i) {
        if (s.entries[i].key == "model.layers.0.self_attn.o_proj.weight") s.entries.erase(s.entries.begin() + i);
      }
    });
    Write("extra", kQwen, [](ModelSpec& s) {
      for (const char* k : {"model.layers.0.mlp.down_proj.weight.absmax", "model.layers.0.mlp.down_proj.weight.quant_map",
                            "model.layers.1.self_attn.q_proj.weight_scale_inv"}) {
        SpecEntry e;
        e.key = k;
        e.shape = {3};
        e.dtype = DType::kF32;
        s.entries.insert(s.entries.begin() + 2, e);  // in the middle: would shift a positional loader
      }
    });
    Write("shape", kQwen, [](ModelSpec& s) {
      for (auto& e : s.entries) if (e.key == "model.layers.1.mlp.gate.weight") e.shape = {6, 48};
    });
    Write("bf16_config", nullptr, {}, R"({"model_type":"llama","num_hidden_layers":1,"hidden_size":32,
      "num_attention_heads":2,"intermediate_size":24,"vocab_size":9,"torch_dtype":"bfloat16"})");
    Write("f16_config", nullptr, {}, R"({"model_type":"llama","num_hidden_layers":1,"hidden_size":32,
      "num_attention_heads":2,"intermediate_size":24,"vocab_size":9,"torch_dtype":"float16"})");
  }
  static void TearDownTestSuite() { delete dir_; }

  // A synthetic checkpoint (spec from `config`, edited) and the config beside it.
  static void Write(const std::string& name, const char* config, std::function<void(ModelSpec&)> edit,
                    const char* config_only = nullptr) {
    std::string d = *dir_ / name;
    mkdir(d.c_str(), 0755);
    if (config_only != nullptr) {
      testing::WriteFile(d + "/config.json", config_only);
      return;
    }
    testing::WriteFile(d + "/config.json", config);
    ModelSpec spec = BuildModelSpecFromJson(d + "/config.json", config);
    if (edit) edit(spec);
    SynthOptions o;
    o.seed = kSeed;
    o.max_shard_bytes = 20000;  // several files
    WriteSynthCheckpoint(spec, d, o);
  }

  static std::string Path(const std::string& name) { return *dir_ / name; }

  // Runs `world` ranks of the worker; `during` may act on them while they run (e.g. kill one). A free
  // port found by one test can be taken by a concurrent one (ctest -j) before rank 0 binds it; then
  // the whole run starts again on another port.
  std::vector<Result> Run(int world, const std::string& scenario, const std::string& ckpt, const std::string& config,
                          const std::string& source = "rank0",
                          const std::function<void(std::vector<Subprocess>&)>& during = nullptr) {
    for (int attempt = 0;; ++attempt) {
      std::vector<Result> out = RunOnce(world, scenario, ckpt, config, source, during);
      bool port_taken = false;
      for (const Result& r : out) port_taken |= r.message.find("EADDRINUSE") != std::string::npos;
      if (!port_taken || attempt == 2) return out;
    }
  }

  std::vector<Result> RunOnce(int world, const std::string& scenario, const std::string& ckpt, const std::string& config,
                              const std::string& source, const std::function<void(std::vector<Subprocess>&)>& during) {
    const int port = FreeLocalPort();
    std::vector<Subprocess> ranks;
    for (int r = 0; r < world; ++r) {
      SpawnOptions so;
      so.argv = {SelfExe(), "--rank-worker", scenario, Path(ckpt), Path(config) + "/config.json", source};
      so.env = {"RANK=" + std::to_string(r), "WORLD_SIZE=" + std::to_string(world), "LOCAL_RANK=" + std::to_string(r),
                "MASTER_ADDR=127.0.0.1", "MASTER_PORT=" + std::to_string(port), "TORCH_CPP_LOG_LEVEL=ERROR"};
      so.pipe_stdout = true;
      ranks.push_back(Subprocess::Spawn(so));
    }
    if (during) during(ranks);
    std::vector<Result> out(world);
    for (int r = 0; r < world; ++r) {
      try {
        while (auto line = ranks[r].ReadLine(std::chrono::seconds(90))) {
          if (line->empty() || (*line)[0] != '{') continue;
          auto j = nlohmann::json::parse(*line);
          Result& x = out[r];
          x.reported = true;
          x.ok = j.value("ok", false);
          x.kind = j.value("kind", "");
          x.message = j.value("message", "");
          x.checked = j.value("checked", 0);
          x.mismatches = j.value("mismatches", 0);
          x.skipped = j.value("skipped", 0);
          x.verified = j.value("verified", 0);
        }
        ranks[r].Wait(std::chrono::seconds(30));
      } catch (const Error& e) {
        ADD_FAILURE() << "rank " << r << " did not finish: " << e.what();
      }
    }
    return out;
  }

  // Every rank failed with the same kind and message, containing every listed substring.
  void ExpectSameError(const std::vector<Result>& rs, const char* kind, std::initializer_list<const char*> parts,
                       std::set<int> absent = {}) {
    const Result* first = nullptr;
    for (size_t r = 0; r < rs.size(); ++r) {
      if (absent.count(static_cast<int>(r))) continue;
      ASSERT_TRUE(rs[r].reported) << "rank " << r << " reported nothing";
      EXPECT_FALSE(rs[r].ok) << "rank " << r << " succeeded";
      EXPECT_EQ(rs[r].kind, kind) << "rank " << r << ": " << rs[r].message;
      if (first == nullptr) first = &rs[r];
      EXPECT_EQ(rs[r].message, first->message) << "rank " << r << " raised a different message";
      for (const char* p : parts) EXPECT_NE(rs[r].message.find(p), std::string::npos) << "lacks \"" << p << "\": " << rs[r].message;
    }
  }

  static testing::TempDir* dir_;
};
testing::TempDir* LoadTest::dir_ = nullptr;

struct ExactCase {
  const char* ckpt;
  const char* config;
};

class LoadExact : public LoadTest, public ::testing::WithParamInterface<std::tuple<ExactCase, int, const char*>> {};

TEST_P(LoadExact, EveryRankHoldsExactlyItsRows) {
  auto [c, world, source] = GetParam();
  auto rs = Run(world, "exact", c.ckpt, c.config, source);
  for (int r = 0; r < world; ++r) {
    ASSERT_TRUE(rs[r].ok) << "rank " << r << ": " << rs[r].kind << ": " << rs[r].message;
    EXPECT_GT(rs[r].checked, 0);
    EXPECT_EQ(rs[r].mismatches, 0) << "rank " << r;
    EXPECT_EQ(rs[r].verified, 1) << "rank " << r;
  }
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, LoadExact,
    ::testing::Combine(::testing::Values(ExactCase{"qwen", "qwen"},                // uneven, zero-row ranks, bf16
                                         ExactCase{"deepseek", "deepseek"},        // fp8 + sidecars + routing bias
                                         ExactCase{"llama_f32", "bf16_config"},    // f32 -> bf16 in the ring
                                         ExactCase{"llama_f32", "f16_config"},     // f32 -> f16
                                         ExactCase{"slow", "slow"}),  // regression: local messages between sends
                                                                      // once wrapped the ring onto a busy slot
                       ::testing::Values(1, 2, 3, 4), ::testing::Values("rank0", "each-rank")),
    [](const auto& info) {
      return std::string(std::get<0>(info.param).ckpt) + "_as_" + std::get<0>(info.param).config + "_w" +
             std::to_string(std::get<1>(info.param)) + "_" +
             (std::string(std::get<2>(info.param)) == "rank0" ? "rank0" : "each_rank");
    });

TEST_F(LoadTest, MissingKeyIsTheSameErrorEverywhere) {
  ExpectSameError(Run(3, "exact", "missing", "qwen"), "ManifestMismatch",
                  {"handshake", "rank 0", "model.layers.0.self_attn.o_proj.weight", "has no tensor"});
}

TEST_F(LoadTest, ExtraSidecarKeysAreSkippedAndCountedNeverShifted) {
  auto rs = Run(3, "exact", "extra", "qwen");
  for (const auto& r : rs) {
    ASSERT_TRUE(r.ok) << r.message;
    EXPECT_EQ(r.mismatches, 0);
    EXPECT_EQ(r.skipped, 3);
  }
  ExpectSameError(Run(3, "strict_keys", "extra", "qwen"), "ManifestMismatch", {"3 key(s) the model does not own"});
}

TEST_F(LoadTest, DtypeDivergenceBetweenRanks) {
  ExpectSameError(Run(3, "dtype_divergence", "qwen", "qwen"), "ManifestMismatch",
                  {"[rank 1]", "model.norm.weight", "dtype BF16 on rank 0 but F32 on rank 1"});
}

TEST_F(LoadTest, ShapeMismatchWithTheCheckpoint) {
  ExpectSameError(Run(2, "exact", "shape", "qwen"), "ManifestMismatch",
                  {"model.layers.1.mlp.gate.weight", "shape [6, 48] in the checkpoint", "[5, 48] in rank 0's plan"});
}

TEST_F(LoadTest, WorldSizeMismatch) {
  ExpectSameError(Run(3, "world_size_mismatch", "qwen", "qwen"), "ManifestMismatch",
                  {"[rank 1]", "world size", "rank 1 for 4", "communicator has 3"});
}

// Regression: a file truncated after the handshake is one clear error on every rank, not SIGBUS.
TEST_F(LoadTest, CheckpointTruncatedAfterTheHandshake) {
  Write("trunc", kSlow, {});
  ExpectSameError(Run(3, "truncate", "trunc", "trunc"), "CheckpointError", {"rank 0", "truncated", ".safetensors"});
}

TEST_F(LoadTest, RankKilledMidStreamEndsEveryRankWithinTheTimeout) {
  auto t0 = std::chrono::steady_clock::now();
  auto rs = Run(4, "slow", "slow", "slow", "rank0", [](std::vector<Subprocess>& ranks) {
    auto line = ranks[0].ReadLine(std::chrono::seconds(60));  // rank 0 is streaming
    ASSERT_TRUE(line && *line == "PROGRESS");
    ranks[2].Kill(SIGKILL);
  });
  EXPECT_FALSE(rs[2].reported);
  for (int r : {0, 1, 3}) {
    ASSERT_TRUE(rs[r].reported) << "rank " << r;
    EXPECT_FALSE(rs[r].ok) << "rank " << r;
  }
  ExpectSameError(rs, rs[0].kind.c_str(), {"rank 2"}, {2});
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(60));
}

}  // namespace
}  // namespace shardcast

int main(int argc, char** argv) {
  if (argc >= 6 && std::string(argv[1]) == "--rank-worker") return LoadWorkerMain(argc, argv);
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
