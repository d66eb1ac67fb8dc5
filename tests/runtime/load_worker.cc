#include "tests/runtime/load_worker.h"

#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <map>
#include <nlohmann/json.hpp>
#include <thread>

#include "loaders/checkpoint.h"
#include "loaders/synth.h"
#include "runtime/load.h"
#include "runtime/materialize/rope.h"
#include "tests/runtime/layout_cases.h"

namespace shardcast {
namespace {

constexpr uint64_t kSeed = 7;

// Checks every byte this rank holds: synthetic checkpoint values (converted to the plan's dtype where
// the checkpoint's differs) for checkpoint entries, the RoPE rule for computed buffers.
void Check(const RankState& state, const Checkpoint& ckpt, const std::vector<SynthQuantizedWeight>& dequantized,
           int64_t* checked, int64_t* mismatches) {
  std::map<std::string, const SynthQuantizedWeight*> fp8;
  for (const auto& q : dequantized) fp8[q.key] = &q;
  for (const LocalTensor& t : state.tensors()) {
    const PlanEntry& e = *t.entry;
    const at::Tensor& x = t.tensor;
    if (e.role == Role::kNonPersistentBuffer) {
      RopeInit r = ComputeRope(nlohmann::json::parse(state.plan().spec().config_json), "c", e.shape[0] * 2);
      *mismatches += std::memcmp(x.data_ptr(), r.inv_freq.data(), r.inv_freq.size() * 4) != 0;
      ++*checked;
      continue;
    }
    const Checkpoint::Entry& ce = ckpt.Get(e.key);
    // The piece's runs, each filled with what the checkpoint holds there, at its local place.
    const Piece piece = e.PieceOf(state.rank());
    const uint64_t n = piece.numel(), ts = DTypeSize(e.dtype);
    std::vector<unsigned char> want(n * ts);
    ForEachRuns(e.shape, piece, [&](const StridedRuns& r) {
      for (uint64_t i = 0; i < r.runs; ++i) {
        const uint64_t first = r.first + i * r.stride;
        unsigned char* out = want.data() + (r.local_first + i * r.local_stride) * ts;
        if (auto q = fp8.find(e.key); q != fp8.end()) {  // what the kernel gives for these elements
          SynthDequantizedElements(kSeed, *q->second, e.dtype, first, r.count, out);
        } else {
          std::vector<unsigned char> src(r.count * DTypeSize(ce.info->dtype));
          SynthElements(kSeed, e.key, ce.info->dtype, first, r.count, src.data());
          ConvertElements(ce.info->dtype, e.dtype, src.data(), out, r.count);
        }
      }
    });
    if (static_cast<uint64_t>(x.numel()) != n || (n != 0 && std::memcmp(x.data_ptr(), want.data(), want.size()) != 0)) {
      ++*mismatches;
      std::cerr << "rank " << state.rank() << ": mismatch in " << e.key << "\n";
    }
    ++*checked;
  }
}

}  // namespace
}  // namespace shardcast

int LoadWorkerMain(int argc, char** argv) {
  using namespace shardcast;
  const auto t0 = std::chrono::steady_clock::now();
  const std::string scenario = argv[2], config = argv[4], source = argv[5];
  std::string ckpt_dir = argv[3];
  nlohmann::json out = {{"ok", false}};
  try {
    Rendezvous rv = RendezvousFromEnvironment();
    if (scenario == "own_view" && rv.rank == 1) ckpt_dir += ".rank1";  // this rank sees another copy
    LoadRequest rq;
    rq.checkpoint = ckpt_dir;
    if (scenario == "blind" && rv.rank == rv.world_size - 1) rq.checkpoint += ".not-here";  // sees no files
    // The worker's defaults, unless the test set the variable for this rank (the environment is how a
    // real node differs from the others).
    LoadOptionsBuilder b;
    auto def = [&b](Option o, const char* v) {
      if (std::getenv(InfoOf(o).environment) == nullptr) b.Set(o, v, "worker default");
    };
    def(Option::kChunkBytes, "64K");  // small: exercise splitting and coalescing
    def(Option::kStagingSlots, "3");
    def(Option::kTimeoutMs, "20000");
    def(Option::kVerify, "1");
    b.Set(Option::kSource, source, "worker argv");
    if (scenario == "strict_keys") b.Set(Option::kStrictKeys, "1", "worker");
    if (scenario == "verify_divergence" && rv.rank == 2) b.Set(Option::kVerify, "0", "worker");
    b.FromEnvironment();
    rq.options = b.Build();
    bool truncated = false, announced = false;
    if (scenario == "truncate" && rv.rank == 0) {
      rq.progress = [&](uint64_t, uint64_t) {  // after the handshake, mid-stream: cut the last file short
        if (truncated) return;
        auto c = Checkpoint::Open(ckpt_dir);
        if (truncate(c->file(c->num_files() - 1).path().c_str(), 4096) != 0) std::perror("truncate");
        truncated = true;
      };
    }
    if (scenario == "slow" && rv.rank == 0) {
      rq.progress = [&](uint64_t done, uint64_t total) {  // long enough a stream to kill a rank in it
        if (!announced && done * 2 >= total) {  // half way: every rank is past the handshake, streaming
          std::cout << "PROGRESS" << std::endl;
          announced = true;
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
      };
    }
    if (scenario == "inflight" && rv.rank == 0) {
      rq.progress = [](uint64_t, uint64_t) { std::cout << "MESSAGE" << std::endl; };  // one line a message
    }
    std::unique_ptr<Communicator> comm =
        rv.world_size == 1 ? CreateLocalCommunicator() : CreateGlooCommunicator(rv, rq.options.timeout);
    ModelSpec spec = BuildModelSpec(config);
    std::vector<SynthQuantizedWeight> dequantized;
    if (scenario == "dequant") {  // a bf16 model of an fp8 checkpoint: the reader dequantizes
      Bf16Twin twin = MakeBf16Twin(spec);
      spec = std::move(twin.spec);
      dequantized = std::move(twin.dequantized);
    }
    // The layouts: FSDP2's, HSDP's R x (W / R) with R from the test, or TEST_LAYOUT's (layout_cases.h).
    PlanOptions plan_options;
    const char* replicas = std::getenv("TEST_REPLICAS");
    plan_options.replicas = replicas ? std::atoi(replicas) : 1;
    if (const char* layout = std::getenv("TEST_LAYOUT")) ApplyTestLayout(layout, rv.world_size, spec, &plan_options);
    if (scenario == "layout_divergence" && rv.rank == 1) {  // this rank parallelized its model differently
      plan_options = PlanOptions{};
      ApplyTestLayout("shard1", rv.world_size, spec, &plan_options);
    }
    int plan_world = rv.world_size;
    if (scenario == "shape_divergence" && rv.rank == rv.world_size - 1) {
      for (auto& e : spec.entries) {
        if (e.key == "model.layers.1.mlp.gate.weight") e.shape[0] += 1;  // one replica disagrees
      }
    }
    if (scenario == "dtype_divergence" && rv.rank == 1) {
      for (auto& e : spec.entries) e.dtype = e.key == "model.norm.weight" ? DType::kF32 : e.dtype;
    }
    if (scenario == "world_size_mismatch" && rv.rank == 1) plan_world = rv.world_size + 1;
    Plan plan = Plan::Build(std::move(spec), plan_world, plan_options);
    RankState state = RankState::Prepare(plan, rv.rank);
    LoadReport report = Load(*comm, &state, rq);
    int64_t checked = 0, mismatches = 0;
    auto ckpt = Checkpoint::Open(ckpt_dir);
    Check(state, *ckpt, dequantized, &checked, &mismatches);
    out = {{"ok", true}, {"checked", checked}, {"mismatches", mismatches}, {"skipped", report.skipped_keys},
           {"verified", report.ranks[rv.rank].verified}, {"stored", report.ranks[rv.rank].bytes_stored},
           {"adopted", report.adopted}, {"dequantized", report.dequantized}, {"read", report.ranks[rv.rank].bytes_read},
           {"read_total", [&] {
              uint64_t t = 0;
              for (const auto& r : report.ranks) t += r.bytes_read;
              return t;
            }()},
           {"checkpoint_bytes", report.checkpoint_bytes}, {"nodes", report.nodes}, {"mesh", report.mesh},
           {"source", report.source}, {"source_reason", report.source_reason}};
  } catch (const Error& e) {
    out = {{"ok", false}, {"kind", ErrorKindName(e.kind())}, {"message", e.what()}};
  } catch (const std::exception& e) {
    out = {{"ok", false}, {"kind", "std"}, {"message", e.what()}};
  }
  out["seconds"] = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::cout << out.dump() << std::endl;
  return 0;
}
