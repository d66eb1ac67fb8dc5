#include "bench/rss_case.h"

#include <ATen/ATen.h>

#include <chrono>
#include <limits>

#include "allocators/tensor_alloc.h"
#include "runtime/materialize/materializer.h"
#include "runtime/materialize/torch_dtype.h"

namespace shardcast::bench {

std::optional<RssStrategy> ParseRssStrategy(const std::string& name) {
  if (name == "zeros-like") return RssStrategy::kZerosLike;
  if (name == "empty-like") return RssStrategy::kEmptyLike;
  if (name == "lazy-zero") return RssStrategy::kLazyZero;
  if (name == "meta") return RssStrategy::kMeta;
  return std::nullopt;
}

const char* RssStrategyName(RssStrategy s) {
  switch (s) {
    case RssStrategy::kZerosLike: return "zeros-like";
    case RssStrategy::kEmptyLike: return "empty-like";
    case RssStrategy::kLazyZero: return "lazy-zero";
    case RssStrategy::kMeta: return "meta";
  }
  return "?";
}

bool Commits(RssStrategy s) { return s == RssStrategy::kZerosLike; }

namespace {

nlohmann::json SnapJson(const MemorySnapshot& m) {
  return {{"vm_rss", m.vm_rss}, {"vm_hwm", m.vm_hwm}, {"rss_anon", m.rss_anon}, {"rss_file", m.rss_file},
          {"rss_shmem", m.rss_shmem}, {"vm_size", m.vm_size}};
}
MemorySnapshot SnapFromJson(const nlohmann::json& j) {
  MemorySnapshot m;
  m.vm_rss = j.at("vm_rss");
  m.vm_hwm = j.at("vm_hwm");
  m.rss_anon = j.at("rss_anon");
  m.rss_file = j.at("rss_file");
  m.rss_shmem = j.at("rss_shmem");
  m.vm_size = j.at("vm_size");
  return m;
}

void Materialize(ModelSpec spec, RssStrategy s, std::vector<at::Tensor>* held) {
  if (s == RssStrategy::kMeta) {
    // shardcast's prepare, plus the meta parameters a model built under torch.device("meta") holds.
    Plan plan = Plan::Build(std::move(spec), 1);
    RankState state = RankState::Prepare(plan, 0);
    for (const LocalTensor& t : state.tensors()) held->push_back(t.is_meta() ? t.MetaTensor() : t.tensor);
    return;
  }
  for (const SpecEntry& e : spec.entries) {
    std::vector<int64_t> sizes(e.shape.begin(), e.shape.end());
    at::ScalarType dtype = ToScalarType(e.dtype);
    switch (s) {
      case RssStrategy::kZerosLike: held->push_back(at::zeros(sizes, dtype)); break;
      case RssStrategy::kEmptyLike: held->push_back(at::empty(sizes, dtype)); break;
      case RssStrategy::kLazyZero: held->push_back(LazyZeroTensor(sizes, dtype)); break;
      case RssStrategy::kMeta: break;
    }
  }
}

}  // namespace

nlohmann::json RssCaseResult::ToJson() const {
  return {{"config", c.config}, {"strategy", RssStrategyName(c.strategy)}, {"layers", layers},
          {"params", params}, {"bytes", bytes}, {"entries", entries}, {"seconds", seconds},
          {"peak_reset", peak_reset}, {"baseline", SnapJson(baseline)}, {"held", SnapJson(held)},
          {"peak", {{"rss_anon", peaks.rss_anon}, {"rss_file", peaks.rss_file}, {"vm_rss", peaks.vm_rss},
                    {"vm_size", peaks.vm_size}, {"vm_hwm", peaks.vm_hwm}}}};
}

RssCaseResult RssCaseResult::FromJson(const nlohmann::json& j) {
  RssCaseResult r;
  r.c.config = j.at("config");
  r.c.strategy = *ParseRssStrategy(j.at("strategy").get<std::string>());
  r.layers = r.c.layers = j.at("layers");
  r.params = j.at("params");
  r.bytes = j.at("bytes");
  r.entries = j.at("entries");
  r.seconds = j.at("seconds");
  r.peak_reset = j.at("peak_reset");
  r.baseline = SnapFromJson(j.at("baseline"));
  r.held = SnapFromJson(j.at("held"));
  const auto& p = j.at("peak");
  r.peaks.rss_anon = p.at("rss_anon");
  r.peaks.rss_file = p.at("rss_file");
  r.peaks.vm_rss = p.at("vm_rss");
  r.peaks.vm_size = p.at("vm_size");
  r.peaks.vm_hwm = p.at("vm_hwm");
  return r;
}

RssCaseResult RunRssCase(const RssCase& c, std::vector<at::Tensor>* held) {
  at::zeros({1024});  // libtorch loaded and its allocator warmed before the baseline
  ModelSpec spec = BuildModelSpec(c.config, SpecOptions{c.layers});
  RssCaseResult r;
  r.c = c;
  r.layers = spec.num_layers;
  r.params = spec.parameter_count();
  r.entries = spec.entries.size();
  for (const auto& e : spec.entries) r.bytes += e.nbytes();
  r.baseline = ReadMemory();
  r.peak_reset = ResetPeak();
  PeakSampler sampler;
  auto t0 = std::chrono::steady_clock::now();
  Materialize(std::move(spec), c.strategy, held);
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  r.peaks = sampler.Stop();
  r.held = ReadMemory();
  return r;
}

NanDemo RunNanDemo() {
  constexpr int64_t kElems = 16 * 1024;  // 32 KiB: below glibc's mmap threshold, so a heap chunk
  NanDemo d;
  d.elements = kElems;
  auto count = [](const at::Tensor& t, int64_t* nonzero, int64_t* nan) {
    *nonzero = std::max(*nonzero, (t.view(at::kShort) != 0).sum().item<int64_t>());
    *nan = std::max(*nan, t.isnan().sum().item<int64_t>());
  };
  for (int i = 0; i < 4; ++i) {
    at::empty({kElems}, at::kBFloat16).fill_(std::numeric_limits<float>::quiet_NaN());
    count(at::empty({kElems}, at::kBFloat16), &d.empty_nonzero, &d.empty_nan);
    LazyZeroTensor({kElems}, at::kBFloat16).fill_(std::numeric_limits<float>::quiet_NaN());
    count(LazyZeroTensor({kElems}, at::kBFloat16), &d.lazy_nonzero, &d.lazy_nan);
  }
  return d;
}

}  // namespace shardcast::bench
