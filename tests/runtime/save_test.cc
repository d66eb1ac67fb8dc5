// Multi-process saves over real c10d Gloo: every rank is this binary re-executed as a worker that
// fills its shards with the synthetic values of a config's entries and saves them. The output must
// hold every entry bit for bit (or converted, with a dtype) and open as a valid checkpoint; every
// failure (a rank killed at any step, a full disk, an existing out_dir, ranks asking for different
// saves) is the same error on every surviving rank, and leaves the previous out_dir intact and nothing
// partial behind.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/resource.h>
#include <xxhash.h>

#include <cctype>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "loaders/checkpoint.h"
#include "tests/runtime/layout_cases.h"
#include "loaders/synth.h"
#include "runtime/save.h"
#include "tests/runtime/load_harness.h"

namespace shardcast {
namespace {

const char* Env(const char* name, const char* fallback) {
  const char* v = std::getenv(name);
  return v != nullptr ? v : fallback;
}

// This rank's rows of every checkpoint entry, with the synthetic values a checkpoint would hold.
void Fill(RankState* state) {
  state->AllocateShards();
  for (LocalTensor& t : state->tensors()) {
    const PlanEntry& e = *t.entry;
    if (e.role == Role::kNonPersistentBuffer) continue;
    auto* base = static_cast<unsigned char*>(t.tensor.data_ptr());
    const uint64_t ts = DTypeSize(e.dtype);
    ForEachRuns(e.shape, e.PieceOf(state->rank()), [&](const StridedRuns& r) {
      for (uint64_t i = 0; i < r.runs; ++i) {
        SynthElements(kSeed, e.key, e.dtype, r.first + i * r.stride, r.count,
                      base + (r.local_first + i * r.local_stride) * ts);
      }
    });
  }
}

// Every saved entry against its synthetic values in the file's dtype; counts the output's extra keys.
nlohmann::json Check(const Plan& plan, const std::string& dir, std::optional<DType> dtype) {
  auto out = Checkpoint::Open(dir);
  int64_t checked = 0, mismatches = 0;
  for (const PlanEntry& e : plan.entries()) {
    if (e.role == Role::kNonPersistentBuffer) continue;
    const Checkpoint::Entry& ce = out->Get(e.key);
    const uint64_t n = ce.info->numel();
    const bool floating = e.dtype == DType::kF16 || e.dtype == DType::kBF16 || e.dtype == DType::kF32;
    const DType want_dtype = dtype && floating ? *dtype : e.dtype;
    std::vector<unsigned char> src(n * DTypeSize(e.dtype)), want(n * DTypeSize(want_dtype)), got(want.size());
    SynthElements(kSeed, e.key, e.dtype, 0, n, src.data());
    ConvertElements(e.dtype, want_dtype, src.data(), want.data(), n);
    ce.file->ReadBytes(ce.file->header().data_offset() + ce.info->begin, got.size(), got.data(), e.key);
    if (ce.info->dtype != want_dtype || ce.info->shape != e.shape || got != want) {
      ++mismatches;
      std::cerr << "mismatch in " << e.key << "\n";
    }
    ++checked;
  }
  return {{"checked", checked}, {"mismatches", mismatches},
          {"skipped", static_cast<int64_t>(out->keys().size()) - checked}, {"files", out->num_files()}};
}

// TEST_BOXES (3 ranks): every parameter in explicit boxes, as code that shards without DTensor declares
// them (torch DCP's chunks): matrices in three uneven boxes, vectors held whole by ranks 0 and 2
// (replicas: written once) and as an empty box by rank 1, scalars by rank 1 alone.
//
//   [R, C]   rank 0  rows [0, R/2), every column      0 0 0 0 0 0
//            rank 1  rows [R/2, R), columns [0, C/3)   1 1 2 2 2 2
//            rank 2  rows [R/2, R), columns [C/3, C)   1 1 2 2 2 2
void ApplyTestBoxes(const ModelSpec& spec, PlanOptions* o) {
  for (const SpecEntry& e : spec.entries) {
    if (e.role != Role::kParameter) continue;
    const std::vector<uint64_t>& s = e.shape;
    const std::vector<uint64_t> zero(s.size(), 0);
    Layout l;
    if (s.size() >= 2) {
      const uint64_t r1 = s[0] / 2, c1 = s[1] / 3;
      Box top{zero, s}, left{zero, s}, right{zero, s};
      top.size[0] = r1;
      left.offset[0] = right.offset[0] = r1;
      left.size[0] = right.size[0] = s[0] - r1;
      left.size[1] = c1;
      right.offset[1] = c1;
      right.size[1] = s[1] - c1;
      l.ranks = {0, 1, 2};
      l.boxes = {top, left, right};
    } else if (s.size() == 1) {
      l.ranks = {0, 1, 2};
      l.boxes = {Box{zero, s}, Box{zero, zero}, Box{zero, s}};
    } else {
      l.ranks = {1};
      l.boxes = {Box{{}, {}}};
    }
    o->layout_of[e.key] = static_cast<uint32_t>(o->layouts.size());
    o->layouts.push_back(std::move(l));
  }
}

// SAVE_FILE_NUMBERS: "alternate" numbers the saved entries 1, 2, 1, 2, ... and names a key no entry has
// number 3 (so n = 3, and no third file); "missing" leaves the first entry out.
std::map<std::string, uint32_t> TestFileNumbers(const std::string& how, const ModelSpec& spec) {
  std::map<std::string, uint32_t> out;
  if (how.empty()) return out;
  uint32_t i = 0;
  for (const SpecEntry& e : spec.entries) {
    if (e.role == Role::kNonPersistentBuffer) continue;
    if (!(how == "missing" && i == 0)) out[e.key] = 1 + i % 2;
    ++i;
  }
  out["not.in.the.model"] = 3;
  return out;
}

int SaveWorkerMain(char** argv) {
  const auto t0 = std::chrono::steady_clock::now();
  const std::string config = argv[4], mode = Env("SAVE_MODE", argv[5]);  // SAVE_MODE: one rank asks for another
  nlohmann::json out = {{"ok", false}};
  try {
    Rendezvous rv = RendezvousFromEnvironment();
    LoadOptionsBuilder b;
    b.Set(Option::kChunkBytes, "64K", "worker");  // small: many messages, split and coalesced
    b.Set(Option::kStagingSlots, "3", "worker");
    if (std::getenv("SHARDCAST_TIMEOUT_MS") == nullptr) b.Set(Option::kTimeoutMs, "20000", "worker");
    b.FromEnvironment();
    b.Set(Option::kSource, mode, "worker argv");
    SaveRequest rq;
    rq.options = b.Build();
    rq.out_dir = Env("SAVE_OUT", "");
    rq.max_shard_bytes = std::stoull(Env("SAVE_MAX_SHARD", "20000"));
    rq.overwrite = std::string(Env("SAVE_OVERWRITE", "0")) == "1";
    if (auto d = ParseDType(Env("SAVE_DTYPE", ""))) rq.dtype = *d;
    std::ifstream cf(config);
    std::stringstream cs;
    cs << cf.rdbuf();
    rq.config_json = cs.str();
    std::unique_ptr<Communicator> comm =
        rv.world_size == 1 ? CreateLocalCommunicator() : CreateGlooCommunicator(rv, rq.options.timeout, "save");
    ModelSpec spec = BuildModelSpec(config);
    PlanOptions plan_options;  // FSDP2's, HSDP's (TEST_REPLICAS) or TEST_LAYOUT's layouts
    if (const char* replicas = std::getenv("TEST_REPLICAS")) plan_options.replicas = std::atoi(replicas);
    if (const char* layout = std::getenv("TEST_LAYOUT")) ApplyTestLayout(layout, rv.world_size, spec, &plan_options);
    if (std::getenv("TEST_BOXES") != nullptr) ApplyTestBoxes(spec, &plan_options);
    rq.file_numbers = TestFileNumbers(Env("SAVE_FILE_NUMBERS", ""), spec);
    rq.keep_other_files = std::string(Env("SAVE_KEEP_OTHERS", "0")) == "1";
    rq.numbered_files = std::string(Env("SAVE_NUMBERED", "0")) == "1";
    Plan plan = Plan::Build(std::move(spec), rv.world_size, plan_options);
    RankState state = RankState::Prepare(plan, rv.rank);
    Fill(&state);
    rlimit old{};
    getrlimit(RLIMIT_FSIZE, &old);
    if (const char* limit = std::getenv("SAVE_FSIZE")) {  // a full disk, as this rank sees it
      signal(SIGXFSZ, SIG_IGN);
      rlimit small = old;
      small.rlim_cur = std::stoull(limit);
      setrlimit(RLIMIT_FSIZE, &small);
    }
    SaveReport report;
    try {
      report = Save(*comm, &state, rq);
    } catch (...) {
      setrlimit(RLIMIT_FSIZE, &old);
      throw;
    }
    setrlimit(RLIMIT_FSIZE, &old);
    out = Check(plan, rq.out_dir, rq.dtype);
    uint64_t written = 0;  // by every rank: each byte once, replicas or not
    for (const SaveRankReport& r : report.ranks) written += r.bytes_written;
    if (written != report.total_bytes) {
      std::cerr << "every rank wrote " << written << " bytes for " << report.total_bytes << "\n";
      out["mismatches"] = out["mismatches"].get<int64_t>() + 1;
    }
    out["ok"] = true;
    out["written"] = report.ranks[rv.rank].bytes_written;
  } catch (const Error& e) {
    out = {{"ok", false}, {"kind", ErrorKindName(e.kind())}, {"message", e.what()}};
  } catch (const std::exception& e) {
    out = {{"ok", false}, {"kind", "std"}, {"message", e.what()}};
  }
  out["seconds"] = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::cout << out.dump() << std::endl;
  return 0;
}

constexpr int kTimeoutMs = 3000;
constexpr double kSlackSeconds = 14;  // as fault_test.cc: fetch, store deadlines, acks, start-up

class SaveTest : public LoadTest {
 protected:
  using Env = std::vector<std::string>;
  // `world` ranks saving `config`'s entries into `out` (a name in the suite's temp dir).
  std::vector<Result> Save(int world, const std::string& config, const std::string& mode, const std::string& out,
                           Env all = {}, std::function<Env(int)> one = nullptr, std::set<int> faulted = {}) {
    return Run(world, "save", config, config, mode, nullptr,
               [&](int r) {
                 Env v = all;
                 if (one) for (auto& x : one(r)) v.push_back(x);
                 v.push_back("SAVE_OUT=" + Path(out));
                 return v;
               },
               faulted);
  }

  static void ExpectOk(const std::vector<Result>& rs, int64_t checked) {
    for (size_t r = 0; r < rs.size(); ++r) {
      ASSERT_TRUE(rs[r].ok) << "rank " << r << ": " << rs[r].kind << ": " << rs[r].message;
      EXPECT_EQ(rs[r].checked, checked) << "rank " << r;
      EXPECT_EQ(rs[r].mismatches, 0) << "rank " << r;
      EXPECT_EQ(rs[r].skipped, 0) << "rank " << r << ": the output has keys the model does not";
    }
  }

  // A digest of every file under a directory (names and bytes), to prove it was not touched.
  static uint64_t Tree(const std::string& dir) {
    std::vector<std::string> files;
    for (auto& f : std::filesystem::recursive_directory_iterator(dir)) files.push_back(f.path().string());
    std::sort(files.begin(), files.end());
    uint64_t h = 0;
    for (auto& f : files) {
      std::string bytes = std::filesystem::is_regular_file(f) ? testing::ReadFile(f) : "";
      h = XXH3_64bits_withSeed(bytes.data(), bytes.size(), XXH3_64bits_withSeed(f.data(), f.size(), h));
    }
    return h;
  }

  std::vector<std::string> Leftovers(const std::string& out) {
    std::vector<std::string> v;
    for (auto& f : std::filesystem::directory_iterator(dir_->path())) {
      const std::string name = f.path().filename().string();
      if (name.rfind(out + ".tmp-", 0) == 0) v.push_back(name);
    }
    return v;
  }
};

// The entries a save writes for a config: all but the non-persistent buffers.
int64_t Saved(const std::string& config_path) {
  int64_t n = 0;
  for (const auto& e : BuildModelSpec(config_path).entries) n += e.role != Role::kNonPersistentBuffer;
  return n;
}

struct ExactCase {
  const char* config;
  const char* dtype;  // "" keeps each entry's
};

class SaveExact : public SaveTest, public ::testing::WithParamInterface<std::tuple<ExactCase, int, const char*>> {};

TEST_P(SaveExact, EveryEntryLandsBitExactInAValidCheckpoint) {
  auto [c, world, mode] = GetParam();
  const std::string out = std::string("exact_") + c.config + c.dtype + "_w" + std::to_string(world) + "_" + mode;
  auto rs = Save(world, c.config, mode, out, {std::string("SAVE_DTYPE=") + c.dtype});
  ExpectOk(rs, Saved(Path(c.config) + "/config.json"));
  EXPECT_TRUE(std::filesystem::exists(Path(out) + "/config.json"));
  EXPECT_TRUE(std::filesystem::exists(Path(out) + "/model.safetensors.index.json"));  // several files
  EXPECT_TRUE(Leftovers(out).empty());
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, SaveExact,
    ::testing::Values(
        // bf16, experts and vocab that do not divide evenly, zero-row ranks at W=4; both modes, W 1-4
        std::make_tuple(ExactCase{"qwen", ""}, 1, "rank0"), std::make_tuple(ExactCase{"qwen", ""}, 1, "each-rank"),
        std::make_tuple(ExactCase{"qwen", ""}, 2, "rank0"), std::make_tuple(ExactCase{"qwen", ""}, 2, "each-rank"),
        std::make_tuple(ExactCase{"qwen", ""}, 3, "rank0"), std::make_tuple(ExactCase{"qwen", ""}, 3, "each-rank"),
        std::make_tuple(ExactCase{"qwen", ""}, 4, "rank0"), std::make_tuple(ExactCase{"qwen", ""}, 4, "each-rank"),
        // bf16 -> f32 on the way out (the file's offsets are in the wider dtype)
        std::make_tuple(ExactCase{"qwen", "F32"}, 3, "rank0"), std::make_tuple(ExactCase{"qwen", "F32"}, 3, "each-rank"),
        // fp8 weights with f32 sidecars and an f32 routing bias; dtype=F16 converts only the bf16/f32 ones
        std::make_tuple(ExactCase{"deepseek", "F16"}, 2, "each-rank"),
        std::make_tuple(ExactCase{"deepseek", ""}, 3, "rank0")),
    [](const auto& info) {
      const ExactCase c = std::get<0>(info.param);
      const int world = std::get<1>(info.param);
      const std::string mode = std::get<2>(info.param);
      return std::string(c.config) + (*c.dtype ? std::string("_to_") + c.dtype : "") + "_w" + std::to_string(world) +
             (mode == "rank0" ? "_rank0" : "_each_rank");
    });

// Save takes every layout it loads: HSDP (each piece written once, by its lowest replica), TP x FSDP with
// _StridedShard, Shard(1) (a strided window per row), experts on their own mesh; both modes.
using LayoutSaveCase = std::tuple<const char* /*env*/, int /*world*/, const char* /*mode*/>;
class SaveLayouts : public SaveTest, public ::testing::WithParamInterface<LayoutSaveCase> {};

TEST_P(SaveLayouts, EveryEntryLandsBitExactOnceFromAnyLayout) {
  const auto [env, world, mode] = GetParam();
  std::string out = std::string("layout_") + env + "_w" + std::to_string(world) + "_" + mode;
  for (char& c : out) c = c == '=' || c == '-' ? '_' : c;
  auto rs = Save(world, "qwen", mode, out, {env});
  ExpectOk(rs, Saved(Path("qwen") + "/config.json"));
  EXPECT_TRUE(Leftovers(out).empty());
}

INSTANTIATE_TEST_SUITE_P(
    Layouts, SaveLayouts,
    ::testing::Values(LayoutSaveCase{"TEST_REPLICAS=2", 4, "each-rank"}, LayoutSaveCase{"TEST_REPLICAS=2", 4, "rank0"},
                      LayoutSaveCase{"TEST_LAYOUT=tp-fsdp", 4, "each-rank"},
                      LayoutSaveCase{"TEST_LAYOUT=tp-fsdp", 4, "rank0"},
                      LayoutSaveCase{"TEST_LAYOUT=shard1", 3, "each-rank"}, LayoutSaveCase{"TEST_LAYOUT=ep", 3, "rank0"}),
    [](const auto& info) {
      std::string s = std::string(std::get<0>(info.param)) + "_w" + std::to_string(std::get<1>(info.param)) + "_" +
                      std::get<2>(info.param);
      for (char& c : s) c = std::isalnum(static_cast<unsigned char>(c)) ? c : '_';
      return s;
    });

// Faults: a rank killed while bytes are written, or at the commit. The earlier out_dir must stay as it
// was, byte for byte; the survivors raise one error; a tmp directory is left only when rank 0 (which
// removes it on failure) is the one killed, and the next save names it, or removes it with overwrite.
// The one exception: a rank lost after every rank synced its bytes, when rank 0 goes on to commit;
// then out_dir is the new, complete checkpoint, and the error says so.
using FaultCase = std::tuple<const char* /*mode*/, const char* /*point*/, int /*rank*/, bool /*committed*/>;
class SaveFaults : public SaveTest, public ::testing::WithParamInterface<FaultCase> {};

TEST_P(SaveFaults, ThePreviousOutDirSurvivesAndEverySurvivorRaisesTheSameError) {
  auto [mode, point, faulted, committed] = GetParam();
  const std::string out = std::string("fault_") + (mode[0] == 'r' ? "rank0" : "each") + "_" + point + std::to_string(faulted);
  const std::string shard = "SAVE_MAX_SHARD=1000000";
  ExpectOk(Save(3, "slow", mode, out, {shard}), Saved(Path("slow") + "/config.json"));
  const uint64_t before = Tree(Path(out));
  const std::string fault = std::to_string(faulted) + ":" + point + ":kill" + (std::string(point) == "save-commit" ? "" : ":5");
  auto rs = Save(3, "slow", mode, out,
                 {shard, "SAVE_OVERWRITE=1", "SAVE_DTYPE=F32", "SHARDCAST_FAULT=" + fault,
                  "SHARDCAST_TIMEOUT_MS=" + std::to_string(kTimeoutMs)},
                 nullptr, {faulted});
  EXPECT_FALSE(rs[faulted].reported) << "the killed rank finished: " << rs[faulted].message;
  ExpectSameError(rs, rs[faulted == 0 ? 1 : 0].kind.c_str(), {}, {faulted});
  for (int r = 0; r < 3; ++r) {
    if (r == faulted) continue;
    EXPECT_TRUE(rs[r].kind == "CommError" || rs[r].kind == "CommTimeout") << rs[r].kind << ": " << rs[r].message;
    EXPECT_LT(rs[r].seconds, kTimeoutMs / 1000.0 + kSlackSeconds) << rs[r].message;
  }
  const auto left = Leftovers(out);
  if (committed) {
    EXPECT_NE(rs[0].message.find("rank 0 had committed"), std::string::npos) << rs[0].message;
    EXPECT_TRUE(left.empty());
    const nlohmann::json c = Check(Plan::Build(BuildModelSpec(Path("slow") + "/config.json"), 1), Path(out), DType::kF32);
    EXPECT_EQ(c["mismatches"], 0) << "the committed out_dir is not the new save, complete";
    EXPECT_EQ(c["checked"], Saved(Path("slow") + "/config.json"));
    return;
  }
  EXPECT_EQ(Tree(Path(out)), before) << "the earlier out_dir changed";
  if (faulted != 0) {
    EXPECT_TRUE(left.empty()) << "rank 0 did not remove its tmp directory: " << left.front();
    return;
  }
  ASSERT_EQ(left.size(), 1u);
  ExpectSameError(Save(3, "slow", mode, out, {shard}), "InvalidArgument",  // both named at once
                  {"save layout", "exists (pass overwrite=True", left[0].c_str(), "did not finish"});
  ExpectOk(Save(3, "slow", mode, out, {shard, "SAVE_OVERWRITE=1", "SAVE_DTYPE=F32"}), Saved(Path("slow") + "/config.json"));
  EXPECT_TRUE(Leftovers(out).empty());
  EXPECT_NE(Tree(Path(out)), before);
}

INSTANTIATE_TEST_SUITE_P(
    Matrix, SaveFaults,
    ::testing::Values(FaultCase{"each-rank", "save-write", 1, false}, FaultCase{"each-rank", "save-write", 0, false},
                      FaultCase{"rank0", "stream", 1, false}, FaultCase{"rank0", "save-write", 0, false},
                      FaultCase{"each-rank", "save-commit", 0, false}, FaultCase{"rank0", "save-commit", 1, true}),
    [](const auto& info) {
      std::string p = std::get<1>(info.param);
      std::replace(p.begin(), p.end(), '-', '_');
      return std::string(std::get<0>(info.param)[0] == 'r' ? "rank0" : "each_rank") + "_" + p + "_kill_rank" +
             std::to_string(std::get<2>(info.param));
    });

// A full disk (RLIMIT_FSIZE): on rank 0, creating the files at their final size fails before any data
// moves; on another rank in each-rank, its write fails mid-stream. Either way one IoError naming the
// rank and the file, and nothing is left behind.
TEST_F(SaveTest, AFullDiskIsOneIoErrorAndLeavesNothing) {
  const std::string big = "disk_full_create";
  ExpectSameError(Save(3, "slow", "rank0", big, {"SAVE_MAX_SHARD=100000000"},
                       [](int r) { return r == 0 ? Env{"SAVE_FSIZE=100000"} : Env{}; }),
                  "IoError", {"save create", "[rank 0]", "model.safetensors", "cannot allocate", "File too large"});
  EXPECT_FALSE(std::filesystem::exists(Path(big)));
  EXPECT_TRUE(Leftovers(big).empty());
  const std::string mid = "disk_full_write";
  ExpectSameError(Save(3, "slow", "each-rank", mid, {"SAVE_MAX_SHARD=100000000"},
                       [](int r) { return r == 1 ? Env{"SAVE_FSIZE=100000"} : Env{}; }),
                  "IoError", {"save stream", "[rank 1] writing", "model.safetensors", "bytes [", "File too large"});
  EXPECT_FALSE(std::filesystem::exists(Path(mid)));
  EXPECT_TRUE(Leftovers(mid).empty());
}

TEST_F(SaveTest, AnExistingOutDirNeedsOverwriteAndIsThenReplaced) {
  const std::string out = "existing";
  const int64_t n = Saved(Path("qwen") + "/config.json");
  ExpectOk(Save(2, "qwen", "each-rank", out), n);
  const uint64_t before = Tree(Path(out));
  ExpectSameError(Save(2, "qwen", "each-rank", out, {"SAVE_DTYPE=F32"}), "InvalidArgument",
                  {"save layout", "[rank 0]", "exists (pass overwrite=True"});
  EXPECT_EQ(Tree(Path(out)), before);
  ExpectOk(Save(2, "qwen", "rank0", out, {"SAVE_DTYPE=F32", "SAVE_OVERWRITE=1"}), n);  // checks the values are f32 now
  EXPECT_TRUE(Leftovers(out).empty());
}

TEST_F(SaveTest, RanksAskingForDifferentSavesFailTogether) {
  ExpectSameError(Save(3, "qwen", "each-rank", "differ", {},
                       [](int r) { return r == 2 ? Env{"SAVE_DTYPE=F16"} : Env{}; }),
                  "InvalidArgument", {"save layout", "[rank 2]", "dtype is \"as held\" on rank 0 but \"F16\""});
  EXPECT_FALSE(std::filesystem::exists(Path("differ")));
}

// Explicit boxes (torch DCP's chunks, code that shards without DTensor): uneven 2-d boxes, replicas and
// empty boxes land bit exact, each byte written once (by the lowest holder of a replicated box). With
// numbered_files, one file is model-00001-of-00001.safetensors with an index, as torch DCP names it.
TEST_F(SaveTest, ExplicitBoxesLandBitExactAndEachByteIsWrittenOnce) {
  for (const std::string mode : {"each-rank", "rank0"}) {
    SCOPED_TRACE(mode);
    const std::string out = "boxes_" + mode;
    ExpectOk(Save(3, "qwen", mode, out, {"TEST_BOXES=1", "SAVE_NUMBERED=1", "SAVE_MAX_SHARD=100000000"}),
             Saved(Path("qwen") + "/config.json"));
    EXPECT_TRUE(std::filesystem::exists(Path(out) + "/model-00001-of-00001.safetensors"));
    EXPECT_TRUE(std::filesystem::exists(Path(out) + "/model.safetensors.index.json"));
    EXPECT_TRUE(Leftovers(out).empty());
  }
}

// file_numbers (DCP's fqn_to_index_mapping): every tensor in the file its number names, files named by
// the largest number (a number no tensor has makes no file), an index; a tensor without a number is one
// InvalidArgument on every rank, and nothing is written.
TEST_F(SaveTest, FileNumbersPlaceEveryTensorAndATensorWithoutOneIsRefused) {
  const std::string out = "numbered";
  ExpectOk(Save(2, "qwen", "each-rank", out, {"SAVE_FILE_NUMBERS=alternate"}), Saved(Path("qwen") + "/config.json"));
  EXPECT_TRUE(std::filesystem::exists(Path(out) + "/model-00001-of-00003.safetensors"));
  EXPECT_TRUE(std::filesystem::exists(Path(out) + "/model-00002-of-00003.safetensors"));
  EXPECT_FALSE(std::filesystem::exists(Path(out) + "/model-00003-of-00003.safetensors"));
  const nlohmann::json index = nlohmann::json::parse(testing::ReadFile(Path(out) + "/model.safetensors.index.json"));
  int i = 0;
  for (const auto& e : BuildModelSpec(Path("qwen") + "/config.json").entries) {
    if (e.role == Role::kNonPersistentBuffer) continue;
    EXPECT_EQ(index["weight_map"][e.key], i++ % 2 ? "model-00002-of-00003.safetensors" : "model-00001-of-00003.safetensors")
        << e.key;
  }
  ExpectSameError(Save(2, "qwen", "each-rank", "numbered_missing", {"SAVE_FILE_NUMBERS=missing"}), "InvalidArgument",
                  {"save layout", "has no file number"});
  EXPECT_FALSE(std::filesystem::exists(Path("numbered_missing")));
}

// keep_other_files: a save over an existing out_dir keeps what the checkpoint does not hold (a tokenizer,
// a folder) and drops the replaced checkpoint's safetensors files and index, in the one atomic swap.
TEST_F(SaveTest, KeepOtherFilesCarriesTheRestOfAnExistingOutDirAcrossTheSwap) {
  const std::string out = "kept";
  const int64_t n = Saved(Path("qwen") + "/config.json");
  ExpectOk(Save(2, "qwen", "each-rank", out), n);
  std::filesystem::create_directories(Path(out) + "/extra");
  testing::WriteFile(Path(out) + "/tokenizer.json", "{\"tok\": 1}");
  testing::WriteFile(Path(out) + "/extra/notes.txt", "notes");
  testing::WriteFile(Path(out) + "/model-00009-of-00009.safetensors", "stale");
  ExpectOk(Save(2, "qwen", "rank0", out, {"SAVE_OVERWRITE=1", "SAVE_KEEP_OTHERS=1", "SAVE_FILE_NUMBERS=alternate"}), n);
  EXPECT_EQ(testing::ReadFile(Path(out) + "/tokenizer.json"), "{\"tok\": 1}");
  EXPECT_EQ(testing::ReadFile(Path(out) + "/extra/notes.txt"), "notes");
  std::set<std::string> safetensors;
  for (auto& f : std::filesystem::directory_iterator(Path(out))) {
    if (f.path().extension() == ".safetensors") safetensors.insert(f.path().filename().string());
  }
  EXPECT_EQ(safetensors, (std::set<std::string>{"model-00001-of-00003.safetensors", "model-00002-of-00003.safetensors"}));
  EXPECT_TRUE(std::filesystem::exists(Path(out) + "/config.json"));
  EXPECT_TRUE(Leftovers(out).empty());
}

// Regression (issue 20): a save asked for node-leader or striped ran as rank0, and its report named
// the mode asked for. A mode save does not have is InvalidArgument on every rank, asked on rank 0 or
// on one other rank only, and nothing is written.
TEST_F(SaveTest, AModeSaveDoesNotHaveIsRefusedOnEveryRank) {
  for (const std::string mode : {"node-leader", "striped"}) {
    SCOPED_TRACE(mode);
    const std::string out = "mode_" + mode;
    ExpectSameError(Save(3, "qwen", mode, out), "InvalidArgument",
                    {"save layout", "[rank 0]", ("source \"" + mode + "\" is not a save source").c_str(), "[rank 2]"});
    EXPECT_FALSE(std::filesystem::exists(Path(out)));
    ExpectSameError(Save(3, "qwen", "each-rank", out, {}, [&](int r) { return r == 1 ? Env{"SAVE_MODE=" + mode} : Env{}; }),
                    "InvalidArgument", {"save layout", "[rank 1]", ("source \"" + mode + "\" is not a save source").c_str()});
    EXPECT_FALSE(std::filesystem::exists(Path(out)));
    EXPECT_TRUE(Leftovers(out).empty());
  }
}

}  // namespace
}  // namespace shardcast

int main(int argc, char** argv) {
  if (argc >= 6 && std::string(argv[1]) == "--rank-worker") return shardcast::SaveWorkerMain(argv);
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
