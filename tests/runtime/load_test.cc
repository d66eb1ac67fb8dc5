// Multi-process loads over real c10d Gloo: every rank is this binary re-executed as a worker
// (load_worker.cc). Bit-exact shards for world sizes 1-4 and both sources; every mismatch becomes the
// same error on every rank within the timeout; nothing hangs, even when a rank is killed.
#include <gtest/gtest.h>
#include <signal.h>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "loaders/writer.h"
#include "tests/runtime/load_harness.h"
#include "tests/runtime/load_worker.h"

namespace shardcast {
namespace {


// Every rank finished, checked something, holds it bit for bit, and verify agreed.
void ExpectEveryRankExactAndVerified(const std::vector<Result>& rs) {
  for (size_t r = 0; r < rs.size(); ++r) {
    ASSERT_TRUE(rs[r].ok) << "rank " << r << ": " << rs[r].kind << ": " << rs[r].message;
    EXPECT_GT(rs[r].checked, 0);
    EXPECT_EQ(rs[r].mismatches, 0) << "rank " << r;
    EXPECT_EQ(rs[r].verified, 1) << "rank " << r;
  }
}

struct ExactCase {
  const char* ckpt;
  const char* config;
};

class LoadExact : public LoadTest, public ::testing::WithParamInterface<std::tuple<ExactCase, int, const char*>> {};

TEST_P(LoadExact, EveryRankHoldsExactlyItsRows) {
  auto [c, world, source] = GetParam();
  auto rs = Run(world, "exact", c.ckpt, c.config, source);
  ExpectEveryRankExactAndVerified(rs);
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

// fp8 checkpoints into a bf16 model: the reader dequantizes with each weight's block scales (uneven
// rows, partial blocks at the bottom and right, shards starting mid-block, zero-row ranks), and every
// rank holds exactly what the kernel gives for its rows, which is torch's own formula bit for bit
// (dequant_torch_test). Receivers never see fp8.
class Fp8Exact : public LoadTest, public ::testing::WithParamInterface<std::tuple<int, const char*>> {};

TEST_P(Fp8Exact, EveryRankHoldsItsRowsDequantized) {
  const auto [world, source] = GetParam();
  auto rs = Run(world, "dequant", "deepseek", "deepseek", source);
  for (int r = 0; r < world; ++r) {
    ASSERT_TRUE(rs[r].ok) << "rank " << r << ": " << rs[r].kind << ": " << rs[r].message;
    EXPECT_EQ(rs[r].mismatches, 0) << "rank " << r;
    EXPECT_EQ(rs[r].verified, 1);
    EXPECT_EQ(rs[r].dequantized, 25u);  // layer 0: 5 attention + 3 MLP; layer 1: 5 + 3 experts x 3 + 3 shared
    EXPECT_EQ(rs[r].skipped, 0) << "the scales are used, not skipped";
  }
}

INSTANTIATE_TEST_SUITE_P(WorldsAndSources, Fp8Exact,
                         ::testing::Combine(::testing::Values(1, 2, 3, 4),
                                            ::testing::Values("rank0", "each-rank", "striped")),
                         [](const auto& info) {
                           std::string s = std::get<1>(info.param);
                           for (char& c : s) c = c == '-' ? '_' : c;
                           return "w" + std::to_string(std::get<0>(info.param)) + "_" + s;
                         });

// ModelOpt NVFP4 checkpoints into a bf16 model: the reader dequantizes each rank's rows from their
// packed E2M1 values, E4M3 block scales and global scale (uneven rows, weights that stay bf16 beside
// them); every rank holds what loaders/nvfp4's kernel gives (tests/python/test_nvfp4.py checks that
// kernel, through the stream, against a torch reference of ModelOpt's dequantization).
class Nvfp4Exact : public LoadTest, public ::testing::WithParamInterface<std::tuple<int, const char*>> {};

TEST_P(Nvfp4Exact, EveryRankHoldsItsRowsDequantized) {
  const auto [world, source] = GetParam();
  auto rs = Run(world, "dequant", "nvfp4", "nvfp4", source);
  for (int r = 0; r < world; ++r) {
    ASSERT_TRUE(rs[r].ok) << "rank " << r << ": " << rs[r].kind << ": " << rs[r].message;
    EXPECT_GT(rs[r].checked, 0);
    EXPECT_EQ(rs[r].mismatches, 0) << "rank " << r;
    EXPECT_EQ(rs[r].verified, 1);
    EXPECT_EQ(rs[r].dequantized, 12u);  // per layer: q, k, v, o, gate, up
    EXPECT_EQ(rs[r].skipped, 0) << "weight_scale, weight_scale_2 and input_scale are consumed, not skipped";
  }
}

// Fused experts from per-expert NVFP4 keys: a Qwen3-MoE's [E, out, in] entries of E parts each.
TEST_F(LoadTest, Nvfp4ExpertsFuseFromPerExpertKeys) {
  for (const char* source : {"rank0", "each-rank"}) {
    auto rs = Run(3, "dequant", "qwen_nvfp4", "qwen_nvfp4", source);
    for (int r = 0; r < 3; ++r) {
      ASSERT_TRUE(rs[r].ok) << source << " rank " << r << ": " << rs[r].kind << ": " << rs[r].message;
      EXPECT_GT(rs[r].checked, 0);
      EXPECT_EQ(rs[r].mismatches, 0) << source << " rank " << r;
      EXPECT_EQ(rs[r].verified, 1);
      EXPECT_GT(rs[r].dequantized, 0u);
      EXPECT_EQ(rs[r].skipped, 0);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(WorldsAndSources, Nvfp4Exact,
                         ::testing::Combine(::testing::Values(1, 2, 3, 4), ::testing::Values("rank0", "each-rank")),
                         [](const auto& info) {
                           std::string s = std::get<1>(info.param);
                           for (char& c : s) c = c == '-' ? '_' : c;
                           return "w" + std::to_string(std::get<0>(info.param)) + "_" + s;
                         });

// Any DTensor layout (layout_cases.h): TP x FSDP with _StridedShard on a 2-d mesh, Shard(1) (a run per
// row), experts on a mesh of their own in another rank order; bf16 and fp8 (dequantized in column
// windows), every source, odd world sizes. Every rank holds exactly its DTensor's local tensor.
using LayoutCase = std::tuple<const char* /*layout*/, const char* /*ckpt*/, int /*world*/, const char* /*source*/>;
class LayoutExact : public LoadTest, public ::testing::WithParamInterface<LayoutCase> {};

TEST_P(LayoutExact, EveryRankHoldsExactlyItsPiece) {
  const auto [layout, ckpt, world, source] = GetParam();
  const std::string scenario = std::string(ckpt) == "deepseek" || std::string(ckpt) == "nvfp4" ? "dequant" : "exact";
  // Two "nodes" (GROUP_RANK), so node-leader has two readers.
  auto rs = Run(world, scenario, ckpt, ckpt, source, nullptr, [l = layout, w = world](int rank) {  // C++17: no binding captured
    return std::vector<std::string>{std::string("TEST_LAYOUT=") + l,
                                    "GROUP_RANK=" + std::to_string(rank * 2 / w)};
  });
  ExpectEveryRankExactAndVerified(rs);
}

INSTANTIATE_TEST_SUITE_P(
    Layouts, LayoutExact,
    ::testing::Values(LayoutCase{"tp-fsdp", "qwen", 4, "rank0"}, LayoutCase{"tp-fsdp", "qwen", 4, "each-rank"},
                      LayoutCase{"tp-fsdp", "qwen", 6, "striped"}, LayoutCase{"tp-fsdp", "qwen", 2, "node-leader"},
                      LayoutCase{"shard1", "qwen", 3, "rank0"}, LayoutCase{"shard1", "qwen", 3, "each-rank"},
                      LayoutCase{"ep", "qwen", 3, "striped"}, LayoutCase{"ep", "qwen", 4, "rank0"},
                      LayoutCase{"shard1", "deepseek", 3, "rank0"}, LayoutCase{"tp-fsdp", "deepseek", 4, "each-rank"},
                      LayoutCase{"ep", "deepseek", 2, "striped"},
                      // NVFP4 in column windows: W=4 cuts 48 columns at 12, inside 16-value blocks
                      LayoutCase{"shard1", "nvfp4", 4, "rank0"}, LayoutCase{"tp-fsdp", "nvfp4", 4, "each-rank"},
                      LayoutCase{"hsdp-tp-fsdp", "nvfp4", 4, "striped"},  // and on an HSDP mesh
                      // W=8 (two "nodes" of 4), and a 3-d mesh (HSDP x FSDP x TP) with every source
                      LayoutCase{"tp-fsdp", "qwen", 8, "node-leader"}, LayoutCase{"ep", "deepseek", 8, "rank0"},
                      LayoutCase{"shard1", "qwen", 8, "each-rank"}, LayoutCase{"hsdp-tp-fsdp", "qwen", 8, "striped"},
                      LayoutCase{"hsdp-tp-fsdp", "deepseek", 8, "each-rank"},
                      LayoutCase{"hsdp-tp-fsdp", "qwen", 4, "rank0"}, LayoutCase{"hsdp-tp-fsdp", "qwen", 4, "node-leader"}),
    [](const auto& info) {
      std::string s = std::string(std::get<0>(info.param)) + "_" + std::get<1>(info.param) + "_w" +
                      std::to_string(std::get<2>(info.param)) + "_" + std::get<3>(info.param);
      for (char& c : s) c = c == '-' ? '_' : c;
      return s;
    });

// An fp8 weight is never cast without its scale: a missing scale, a scale of another grid, and a
// scale of a dtype no kernel takes are each one error on every rank, before any data moves.
TEST_F(LoadTest, Fp8WithoutAUsableScaleIsOneErrorEverywhere) {
  const std::string victim = "model.layers.0.self_attn.q_a_proj.weight";
  Write("fp8_no_scale", kDeepseekFp8, [&](ModelSpec& s) {
    for (size_t i = 0; i < s.entries.size(); ++i) {
      if (s.entries[i].key == victim + "_scale_inv") s.entries.erase(s.entries.begin() + i);
    }
  });
  ExpectSameError(Run(3, "dequant", "fp8_no_scale", "deepseek"), "CheckpointError",
                  {"handshake", ("'" + victim + "'").c_str(), "has no '", "never cast without its scale"});
  Write("fp8_bad_grid", kDeepseekFp8, [&](ModelSpec& s) {
    for (auto& e : s.entries) {
      if (e.key == victim + "_scale_inv") e.shape = {2, 2};  // q_a_proj is [40, 136]: its grid is [1, 2]
    }
  });
  ExpectSameError(Run(3, "dequant", "fp8_bad_grid", "deepseek"), "CheckpointError",
                  {"handshake", victim.c_str(), "[2, 2]", "[40, 136]"});
  Write("fp8_bad_dtype", kDeepseekFp8, [&](ModelSpec& s) {
    for (auto& e : s.entries) {
      if (e.key == victim + "_scale_inv") e.dtype = DType::kI32;
    }
  });
  ExpectSameError(Run(2, "dequant", "fp8_bad_dtype", "deepseek", "each-rank"), "Unsupported",
                  {"handshake", victim.c_str(), "I32"});
}

// An NVFP4 weight is never read without both its scales, and never with scales of another shape: each
// is one CheckpointError on every rank, naming the key and the shapes, before any data moves.
TEST_F(LoadTest, Nvfp4WithoutUsableScalesIsOneErrorEverywhere) {
  const std::string m = "model.layers.1.mlp.gate_proj";
  auto drop = [&](const std::string& key) {
    return [key](ModelSpec& s) {
      for (size_t i = 0; i < s.entries.size(); ++i) {
        if (s.entries[i].key == key) s.entries.erase(s.entries.begin() + i);
      }
    };
  };
  Write("nvfp4_no_scale", kLlamaNvfp4, drop(m + ".weight_scale"));
  ExpectSameError(Run(3, "dequant", "nvfp4_no_scale", "nvfp4"), "CheckpointError",
                  {"handshake", (m + ".weight' U8 [37, 24]").c_str(), (m + ".weight_scale_2' F32 []").c_str(),
                   ("no '" + m + ".weight_scale'").c_str()});
  Write("nvfp4_no_global", kLlamaNvfp4, drop(m + ".weight_scale_2"));
  ExpectSameError(Run(2, "dequant", "nvfp4_no_global", "nvfp4", "each-rank"), "CheckpointError",
                  {"handshake", (m + ".weight_scale' F8_E4M3 [37, 3]").c_str(), ("no '" + m + ".weight_scale_2'").c_str()});
  Write("nvfp4_bad_grid", kLlamaNvfp4, [&](ModelSpec& s) {
    for (auto& e : s.entries) {
      if (e.key == m + ".weight_scale") e.shape = {37, 2};
    }
  });
  ExpectSameError(Run(3, "dequant", "nvfp4_bad_grid", "nvfp4"), "CheckpointError",
                  {"handshake", (m + ".weight").c_str(), "U8 [37, 24]", "F8_E4M3 [37, 2]", "do not pair"});
}

// A rank whose model was parallelized differently is one ManifestMismatch on every rank, naming the key,
// both ranks and both layouts, before any data moves.
TEST_F(LoadTest, ADifferentLayoutOnOneRankIsTheSameErrorEverywhere) {
  ExpectSameError(Run(4, "layout_divergence", "qwen", "qwen", "rank0", nullptr,
                      [](int) { return std::vector<std::string>{"TEST_LAYOUT=tp-fsdp"}; }),
                  "ManifestMismatch",
                  {"handshake", "rank 1", "layout mesh (2, 2) over ranks [0, 1, 2, 3]: (_StridedShard(dim=0, sf=2), "
                   "Shard(dim=0)) on rank 0 but mesh (4,) over ranks [0, 1, 2, 3]: (Shard(dim=1)) on rank 1"});
}

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

// Regression (issue 9): a rank with its own SHARDCAST_CHUNK_BYTES / SHARDCAST_STAGING_SLOTS built its
// own schedule and sent or expected messages no other rank did. Rank 0's values now shape the stream.
TEST_F(LoadTest, ARankWithItsOwnChunkAndStagingAdoptsRank0s) {
  for (const char* source : {"rank0", "each-rank"}) {
    auto rs = Run(3, "exact", "qwen", "qwen", source, nullptr, [](int r) -> std::vector<std::string> {
      if (r == 1) return {"SHARDCAST_CHUNK_BYTES=4K", "SHARDCAST_STAGING_SLOTS=2"};
      return {};
    });
    for (int r = 0; r < 3; ++r) {
      ASSERT_TRUE(rs[r].ok) << source << " rank " << r << ": " << rs[r].message;
      EXPECT_EQ(rs[r].mismatches, 0);
      EXPECT_EQ(rs[r].verified, 1);
    }
    ASSERT_EQ(rs[1].adopted.size(), 2u) << source;
    EXPECT_EQ(rs[1].adopted[0], "chunk_bytes 65536 (rank 0's; this rank asked for 4096)");
    EXPECT_TRUE(rs[0].adopted.empty());
  }
}

TEST_F(LoadTest, OptionsThatChangeTheResultMustMatch) {
  ExpectSameError(Run(3, "verify_divergence", "qwen", "qwen"), "ManifestMismatch",
                  {"handshake", "[rank 2]", "verify is on on rank 0 but off on rank 2"});
}

// Regression (issue 9): a shard that could not be allocated threw on one rank after the handshake,
// while the others entered the stream and waited out the timeout.
TEST_F(LoadTest, AnAllocationRefusedOnOneRankIsTheSameErrorEverywhereAtOnce) {
  for (const char* source : {"rank0", "each-rank"}) {
    auto rs = Run(3, "exact", "qwen", "qwen", source, nullptr,
                  [](int) -> std::vector<std::string> { return {"SHARDCAST_FAULT=1:allocate:enomem"}; });
    ExpectSameError(rs, "IoError", {"allocate", "[rank 1] cannot allocate this rank's shards", "Cannot allocate memory"});
    for (const Result& r : rs) EXPECT_LT(r.seconds, 15.0) << "waited for the timeout instead of agreeing";
  }
}

// Regression (issue 10): in each-rank, a rank whose index listed one more file numbered the files
// differently and read past a mapping (a segfault). Files are now matched by name, size and digest.
TEST_F(LoadTest, EachRankMatchesFilesByNameNeverByNumber) {
  namespace fs = std::filesystem;
  const std::string copy = Path("qwen") + ".rank1";
  fs::remove_all(copy);
  fs::copy(Path("qwen"), copy);
  testing::TempDir extra;
  WriteCheckpoint(extra.path(), {{"extra.weight", DType::kF32, {3}}},
                  [](const WriteEntry&, uint64_t, unsigned char* out, size_t n) { std::memset(out, 1, n); });
  fs::copy_file(extra / "model.safetensors", copy + "/model-00000-extra.safetensors");  // sorts first
  nlohmann::json index = nlohmann::json::parse(testing::ReadFile(copy + "/model.safetensors.index.json"));
  index["weight_map"]["extra.weight"] = "model-00000-extra.safetensors";
  testing::WriteFile(copy + "/model.safetensors.index.json", index.dump());
  auto rs = Run(3, "own_view", "qwen", "qwen", "each-rank");
  for (int r = 0; r < 3; ++r) {
    ASSERT_TRUE(rs[r].ok) << "rank " << r << ": " << rs[r].message;
    EXPECT_EQ(rs[r].mismatches, 0) << "rank " << r;
  }
  // The same file name with another header (a dtype changed, same size): a mismatch, before any read.
  fs::remove_all(copy);
  fs::copy(Path("qwen"), copy);
  std::string victim;
  for (const auto& f : fs::directory_iterator(copy)) {
    std::string bytes = testing::ReadFile(f.path());
    const std::string from = "\"dtype\":\"BF16\"", to = "\"dtype\": \"F16\"";  // same length
    const size_t at = bytes.find(from);
    if (f.path().extension() != ".safetensors" || at == std::string::npos) continue;
    bytes.replace(at, from.size(), to);
    testing::WriteFile(f.path(), bytes);
    victim = f.path().filename();
    break;
  }
  ASSERT_FALSE(victim.empty());
  ExpectSameError(Run(3, "own_view", "qwen", "qwen", "each-rank"), "ManifestMismatch",
                  {"[rank 1]", ("file '" + victim + "'").c_str(), "header differs between rank 0 and rank 1"});
  // The same header with other values (another step of the same run, a copy with other weights): found by
  // the data samples (here its last bytes), before any read. It once loaded a mix of both checkpoints.
  fs::remove_all(copy);
  fs::copy(Path("qwen"), copy);
  victim.clear();
  for (const auto& f : fs::directory_iterator(copy)) {
    if (f.path().extension() != ".safetensors") continue;
    std::string bytes = testing::ReadFile(f.path());
    for (size_t i = bytes.size() - 64; i < bytes.size(); ++i) bytes[i] = static_cast<char>(~bytes[i]);
    testing::WriteFile(f.path(), bytes);
    victim = f.path().filename();
    break;
  }
  ASSERT_FALSE(victim.empty());
  ExpectSameError(Run(3, "own_view", "qwen", "qwen", "each-rank"), "ManifestMismatch",
                  {"[rank 1]", ("file '" + victim + "'").c_str(), "data differs between rank 0 and rank 1"});
  fs::remove_all(copy);
}

// Regression (issue 10): a truncated file in each-rank mode printed a different message on each rank.
TEST_F(LoadTest, CheckpointTruncatedAfterTheHandshakeEachRank) {
  Write("trunc_each", kSlow, {});
  ExpectSameError(Run(3, "truncate", "trunc_each", "trunc_each", "each-rank"), "CheckpointError",
                  {"stream", "truncated", ".safetensors"});
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
