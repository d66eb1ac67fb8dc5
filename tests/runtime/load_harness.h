// The multi-process harness of the load tests: synthetic checkpoints in a shared temp dir, and real
// ranks (this test binary re-executed as load_worker) over c10d Gloo, each reporting one JSON line.
#pragma once

#include <gtest/gtest.h>
#include <signal.h>
#include <sys/stat.h>

#include <chrono>
#include <functional>
#include <nlohmann/json.hpp>
#include <set>
#include <thread>
#include <string>
#include <vector>

#include "loaders/synth.h"
#include "tests/loaders/test_util.h"
#include "tools/subprocess.h"

namespace shardcast {

inline constexpr uint64_t kSeed = 7;

inline const char* kQwen = R"({"model_type":"qwen3_moe","num_hidden_layers":2,"hidden_size":48,"num_attention_heads":4,
  "num_key_value_heads":2,"head_dim":12,"intermediate_size":40,"moe_intermediate_size":20,"num_experts":5,
  "vocab_size":13,"mlp_only_layers":[0],"torch_dtype":"bfloat16","rope_theta":10000})";
inline const char* kDeepseekFp8 = R"({"model_type":"deepseek_v3","num_hidden_layers":2,"hidden_size":136,
  "intermediate_size":72,"moe_intermediate_size":24,"num_attention_heads":2,"q_lora_rank":40,"kv_lora_rank":24,
  "qk_nope_head_dim":8,"qk_rope_head_dim":8,"v_head_dim":8,"n_routed_experts":3,"n_shared_experts":1,
  "first_k_dense_replace":1,"vocab_size":11,"max_position_embeddings":512,"torch_dtype":"bfloat16",
  "rope_scaling":{"type":"yarn","factor":4,"original_max_position_embeddings":128},
  "quantization_config":{"quant_method":"fp8","weight_block_size":[128,128]}})";
// ModelOpt NVFP4: q/k/v/o and gate/up are U8 [out, in / 2] + F8_E4M3 scales + F32 globals (in = 48);
// down_proj (in = 37, not a multiple of 16) and the head stay bf16. gate/up's 37 rows never divide.
inline const char* kLlamaNvfp4 = R"({"model_type":"llama","num_hidden_layers":2,"hidden_size":48,
  "num_attention_heads":3,"num_key_value_heads":1,"head_dim":16,"intermediate_size":37,"vocab_size":13,
  "torch_dtype":"bfloat16","quantization_config":{"quant_method":"modelopt","quant_algo":"NVFP4","group_size":16}})";
// The same as a Qwen3-MoE: every expert's gate/up/down (in = 48 or 32) NVFP4 per expert key, fused by the
// plan into one [E, ...] entry of parts; the dense layer's down_proj (in = 40) stays bf16. 5 experts.
inline const char* kQwenNvfp4 = R"({"model_type":"qwen3_moe","num_hidden_layers":2,"hidden_size":48,
  "num_attention_heads":4,"num_key_value_heads":2,"head_dim":16,"intermediate_size":40,"moe_intermediate_size":32,
  "num_experts":5,"vocab_size":13,"mlp_only_layers":[0],"torch_dtype":"bfloat16","rope_theta":10000,
  "quantization_config":{"quant_method":"modelopt","quant_algo":"NVFP4","group_size":16}})";
inline const char* kLlamaF32 = R"({"model_type":"llama","num_hidden_layers":1,"hidden_size":32,"num_attention_heads":2,
  "intermediate_size":24,"vocab_size":9,"torch_dtype":"float32"})";
inline const char* kSlow = R"({"model_type":"qwen3_moe","num_hidden_layers":2,"hidden_size":256,"num_attention_heads":4,
  "num_key_value_heads":2,"head_dim":64,"intermediate_size":512,"moe_intermediate_size":256,"num_experts":8,
  "vocab_size":1001,"torch_dtype":"bfloat16"})";

struct Result {
  bool ok = false;
  std::string kind, message;
  int64_t checked = 0, mismatches = 0, skipped = 0, verified = 0;
  std::vector<std::string> adopted;
  double seconds = 0;  // from the worker's start to its report
  uint64_t read_total = 0, checkpoint_bytes = 0, dequantized = 0;  // storage reads of every rank; the checkpoint's bytes
  int nodes = 0;
  std::string mesh;
  std::string source, source_reason;  // the route that ran, and why (auto's choice)
  bool reported = false;
  int exit_status = -1;  // the worker's exit code, or 128 + signal
  bool frozen = false;  // a faulted rank still running after the others ended (then killed)
};

class LoadTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new testing::TempDir();
    Write("qwen", kQwen, {});
    Write("deepseek", kDeepseekFp8, {});
    Write("llama_f32", kLlamaF32, {});
    Write("nvfp4", kLlamaNvfp4, {});
    Write("qwen_nvfp4", kQwenNvfp4, {});
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

  // Runs `world` ranks of the worker; `during` may act on them while they run (e.g. kill one). The
  // rendezvous port is bound here and handed to rank 0 (as the launcher does), so a concurrent test
  // can never take it. `env(rank)` adds variables for one rank.
  std::vector<Result> Run(int world, const std::string& scenario, const std::string& ckpt, const std::string& config,
                          const std::string& source = "rank0",
                          const std::function<void(std::vector<Subprocess>&)>& during = nullptr,
                          const std::function<std::vector<std::string>(int)>& env = nullptr,
                          const std::set<int>& faulted = {}) {
    LocalListener listener = LocalListener::Open();
    std::vector<Subprocess> ranks;
    for (int r = 0; r < world; ++r) {
      SpawnOptions so;
      so.argv = {SelfExe(), "--rank-worker", scenario, Path(ckpt), Path(config) + "/config.json", source};
      so.env = {"RANK=" + std::to_string(r), "WORLD_SIZE=" + std::to_string(world), "LOCAL_RANK=" + std::to_string(r),
                "MASTER_ADDR=127.0.0.1", "MASTER_PORT=" + std::to_string(listener.port()), "TORCH_CPP_LOG_LEVEL=ERROR"};
      if (r == 0) {
        so.env.push_back("SHARDCAST_LISTEN_FD=" + std::to_string(listener.fd()));
        so.inherit_fds = {listener.fd()};
      }
      bool switch_given = false;
      if (env) {
        for (auto& v : env(r)) {
          switch_given |= v.rfind("SHARDCAST_TEST_FAULTS=", 0) == 0;
          so.env.push_back(v);
        }
      }
      if (!switch_given) so.env.push_back("SHARDCAST_TEST_FAULTS=1");  // SHARDCAST_FAULT acts only in tests
      so.pipe_stdout = true;
      ranks.push_back(Subprocess::Spawn(so));
    }
    listener.Close();  // as the launcher: the port dies with rank 0 (LocalListener::Close)
    if (during) during(ranks);
    std::vector<Result> out(world);
    // The survivors first; a faulted rank that is still running after them (frozen) is killed.
    std::vector<int> order;
    for (int r = 0; r < world; ++r) if (!faulted.count(r)) order.push_back(r);
    for (int r : faulted) order.push_back(r);
    for (int r : order) {
      if (faulted.count(r)) {
        for (int i = 0; i < 50 && ranks[r].running(); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(20));
        if (ranks[r].running()) {
          out[r].frozen = true;
          ranks[r].Kill(SIGKILL);
        }
      }
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
          x.adopted = j.value("adopted", std::vector<std::string>{});
          x.seconds = j.value("seconds", 0.0);
          x.read_total = j.value("read_total", uint64_t{0});
          x.checkpoint_bytes = j.value("checkpoint_bytes", uint64_t{0});
          x.nodes = j.value("nodes", 0);
          x.dequantized = j.value("dequantized", uint64_t{0});
          x.mesh = j.value("mesh", "");
          x.source = j.value("source", "");
          x.source_reason = j.value("source_reason", "");
        }
        out[r].exit_status = ranks[r].Wait(std::chrono::seconds(30));
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

}  // namespace shardcast
