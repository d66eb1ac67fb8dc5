// Google Benchmark: the checkpoint layer's hot paths, in real time and decimal GB/s.
//   BM_ParseDeepseekHeaders  validating DeepSeek-V3-sized headers: its spec (+ the MTP layer's keys,
//                            ~91k tensors) split over 163 files, parsed from memory
//   BM_OpenDeepseekCheckpoint the same as real sparse files on disk: Checkpoint::Open (index, mmap)
//   BM_RowRangeCopy          ReadRows out of the mmap, warm page cache, 64 MiB row ranges
//   BM_Memcpy                plain memcpy of the same bytes between anonymous buffers
#include <benchmark/benchmark.h>
#include <unistd.h>

#include <cstring>
#include <string>
#include <vector>

#include "loaders/checkpoint.h"
#include "loaders/model_spec.h"
#include "loaders/synth.h"
#include "loaders/writer.h"

namespace shardcast {
namespace {

std::string ConfigPath(const char* name) { return std::string(SHARDCAST_SOURCE_DIR) + "/configs/models/" + name; }

// DeepSeek-V3's published checkpoint: 62 layers' keys (61 + the MTP layer), 163 files.
std::vector<WriteEntry> DeepseekEntries() {
  std::string cfg = ConfigPath("deepseek-v3.json");
  ModelSpec spec = BuildModelSpec(cfg);
  std::vector<WriteEntry> entries = CheckpointEntries(spec);
  for (const auto& e : spec.entries) {  // layer 60's keys again as layer 61, like the MTP layer
    if (e.layer == 60 && e.role != Role::kNonPersistentBuffer) {
      std::string key = e.key;
      key.replace(key.find("layers.60"), 9, "layers.61");
      entries.push_back({key, e.dtype, e.shape});
    }
  }
  return entries;
}

std::vector<std::vector<WriteEntry>> Split(const std::vector<WriteEntry>& entries, size_t files) {
  std::vector<std::vector<WriteEntry>> out(files);
  for (size_t i = 0; i < entries.size(); ++i) out[i * files / entries.size()].push_back(entries[i]);
  return out;
}

void BM_ParseDeepseekHeaders(benchmark::State& state) {
  auto groups = Split(DeepseekEntries(), 163);
  std::vector<std::string> headers;
  std::vector<uint64_t> sizes;
  size_t tensors = 0, header_bytes = 0;
  for (const auto& g : groups) {
    headers.push_back(BuildHeader(g, {{"format", "pt"}}));
    uint64_t data = 0;
    for (const auto& e : g) data += e.nbytes();
    sizes.push_back(headers.back().size() + data);
    tensors += g.size();
    header_bytes += headers.back().size();
  }
  for (auto _ : state) {
    size_t n = 0;
    for (size_t i = 0; i < headers.size(); ++i) {
      Header h = ParseHeader("bench", std::string_view(headers[i]).substr(8), sizes[i]);
      n += h.tensors.size();
    }
    if (n != tensors) state.SkipWithError("tensor count mismatch");
  }
  state.counters["tensors"] = static_cast<double>(tensors);
  state.counters["files"] = 163;
  state.counters["header_MB"] = header_bytes / 1e6;
  state.counters["GB/s"] = benchmark::Counter(static_cast<double>(header_bytes) / 1e9, benchmark::Counter::kIsIterationInvariantRate);
}
BENCHMARK(BM_ParseDeepseekHeaders)->Unit(benchmark::kMillisecond)->UseRealTime();

std::string TempDirPath(const char* tag) {
  std::string tmpl = std::string("/tmp/shardcast-bench-") + tag + "-XXXXXX";
  if (mkdtemp(tmpl.data()) == nullptr) return {};
  return tmpl;
}

void BM_OpenDeepseekCheckpoint(benchmark::State& state) {
  std::string dir = TempDirPath("ds");
  auto entries = DeepseekEntries();
  uint64_t total = 0;
  for (const auto& e : entries) total += e.nbytes();
  CheckpointWriteOptions opt;
  opt.sparse = true;
  opt.max_shard_bytes = total / 163 + 1;
  WrittenCheckpoint w = WriteCheckpoint(dir, entries, nullptr, opt);
  for (auto _ : state) {
    auto ckpt = Checkpoint::Open(dir);
    if (ckpt->keys().size() != entries.size()) state.SkipWithError("key count mismatch");
  }
  state.counters["tensors"] = static_cast<double>(entries.size());
  state.counters["files"] = static_cast<double>(w.files.size());
  if (std::system(("rm -rf '" + dir + "'").c_str()) != 0) state.SkipWithError("cleanup failed");
}
BENCHMARK(BM_OpenDeepseekCheckpoint)->Unit(benchmark::kMillisecond)->UseRealTime()->Iterations(5);

constexpr uint64_t kFileBytes = 1ull << 30;
constexpr uint64_t kRowBytes = 4096 * 2;  // a bf16 row of 4096
constexpr uint64_t kChunkBytes = 64ull << 20;

void BM_RowRangeCopy(benchmark::State& state) {
  std::string dir = TempDirPath("rows");
  const uint64_t rows = kFileBytes / kRowBytes;
  SynthOptions opt;
  WriteEntry e{"w", DType::kBF16, {rows, kRowBytes / 2}};
  WriteCheckpoint(dir, {e}, [](const WriteEntry& e, uint64_t off, unsigned char* out, size_t n) {
    SynthElements(0, e.key, e.dtype, off / 2, n / 2, out);
  });
  auto f = SafetensorsFile::Open(dir + "/model.safetensors");
  const TensorInfo& t = f->Get("w");
  std::vector<unsigned char> dst(kChunkBytes);
  const uint64_t rows_per_chunk = kChunkBytes / kRowBytes;
  for (uint64_t r = 0; r < rows; r += rows_per_chunk) f->ReadRows(t, r, r + rows_per_chunk, dst.data());  // warm
  for (auto _ : state) {
    for (uint64_t r = 0; r < rows; r += rows_per_chunk) f->ReadRows(t, r, r + rows_per_chunk, dst.data());
    benchmark::DoNotOptimize(dst.data());
  }
  // Correctness next to the timing: the last chunk holds exactly the synthetic values.
  if (SynthFirstMismatch(0, "w", DType::kBF16, (rows - rows_per_chunk) * (kRowBytes / 2), kChunkBytes / 2,
                         dst.data()) != UINT64_MAX) {
    state.SkipWithError("row range copy returned wrong bytes");
  }
  state.counters["GB/s"] = benchmark::Counter(kFileBytes / 1e9, benchmark::Counter::kIsIterationInvariantRate);
  if (std::system(("rm -rf '" + dir + "'").c_str()) != 0) state.SkipWithError("cleanup failed");
}
BENCHMARK(BM_RowRangeCopy)->Unit(benchmark::kMillisecond)->UseRealTime()->MinTime(2);

void BM_Memcpy(benchmark::State& state) {
  std::vector<unsigned char> src(kFileBytes, 1), dst(kChunkBytes);
  for (auto _ : state) {
    for (uint64_t off = 0; off < kFileBytes; off += kChunkBytes) std::memcpy(dst.data(), src.data() + off, kChunkBytes);
    benchmark::DoNotOptimize(dst.data());
  }
  if (dst[12345] != 1) state.SkipWithError("memcpy returned wrong bytes");
  state.counters["GB/s"] = benchmark::Counter(kFileBytes / 1e9, benchmark::Counter::kIsIterationInvariantRate);
}
BENCHMARK(BM_Memcpy)->Unit(benchmark::kMillisecond)->UseRealTime()->MinTime(2);

}  // namespace
}  // namespace shardcast

BENCHMARK_MAIN();
