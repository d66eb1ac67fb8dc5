// libFuzzer target: DecodeManifest, the decoder every rank runs on the bytes rank 0 broadcasts. Any
// input must either decode or throw shardcast::Error; anything else (crash, sanitizer report, other
// exception, a hang) is a bug. What is accepted must keep the contract:
//   - re-encoding is stable: Encode(Decode(Encode(m))) == Encode(m) for the decoded m (the decoder
//     normalizes, e.g. an empty part key to the entry's, so the first re-encoding may differ from the input);
//   - every entry's layout describes its shape: each rank's piece, walked as strided runs (what the
//     schedule and the sinks do with it), covers exactly piece.numel() elements, every run inside the
//     global tensor and inside the local one;
//   - the check a receiving rank runs (CheckManifest) agrees with a rank whose plan is the manifest's own
//     (its keys, shapes, dtypes, roles and layouts), and names the key when that plan's first entry has
//     another dtype. A manifest whose layouts such a plan rejects (Plan::Build throws) is one no rank
//     could have planned; it is only decoded.
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "allocators/error.h"
#include "loaders/model_spec.h"
#include "runtime/layout/layout.h"
#include "runtime/layout/plan.h"
#include "runtime/manifest/manifest.h"

namespace {

// Walks of bigger tensors or worlds prove nothing more and would only slow the fuzzer down.
constexpr uint64_t kMaxWalkedElements = 1 << 16;
constexpr int kMaxWalkedRanks = 16;
constexpr size_t kMaxWalkedEntries = 8;
// The check against a plan is linear in the entries; the seeds have a dozen.
constexpr size_t kMaxCheckedEntries = 64;

// The element count, or 0 when it exceeds kMaxWalkedElements (overflow-safe).
uint64_t SmallNumel(const std::vector<uint64_t>& shape) {
  uint64_t n = 1;
  for (uint64_t d : shape) {
    if (d == 0) return 0;
    if (d > kMaxWalkedElements || n * d > kMaxWalkedElements) return 0;
    n *= d;
  }
  return n;
}

void CheckPieces(const shardcast::Manifest& m) {
  for (size_t i = 0; i < m.entries.size() && i < kMaxWalkedEntries; ++i) {
    const shardcast::ManifestEntry& e = m.entries[i];
    const uint64_t numel = SmallNumel(e.shape);
    if (numel == 0) continue;
    for (int rank = 0; rank < m.world_size && rank < kMaxWalkedRanks; ++rank) {
      const shardcast::Piece piece = shardcast::PieceOf(e.shape, m.LayoutOf(e), rank);
      const uint64_t local = piece.numel();
      uint64_t covered = 0;
      shardcast::ForEachRuns(e.shape, piece, [&](const shardcast::StridedRuns& r) {
        if (r.runs == 0 || r.count == 0) __builtin_trap();  // an empty run is never emitted
        const uint64_t last = r.first + (r.runs - 1) * r.stride + r.count;
        const uint64_t local_last = r.local_first + (r.runs - 1) * r.local_stride + r.count;
        if (last > numel || local_last > local) __builtin_trap();  // a run outside the tensor
        covered += r.runs * r.count;
      });
      if (covered != local) __builtin_trap();  // the runs are not the piece
    }
  }
}

// The plan of a rank that planned exactly what the manifest says, but with `first_dtype` for its first
// entry. Throws shardcast::Error where no plan can hold the manifest's layouts.
shardcast::Plan PlanOf(const shardcast::Manifest& m, shardcast::DType first_dtype) {
  shardcast::ModelSpec spec;
  shardcast::PlanOptions options;
  options.layouts = m.layouts;
  for (const shardcast::ManifestEntry& e : m.entries) {
    shardcast::SpecEntry s;
    s.key = e.key;
    s.shape = e.shape;
    s.dtype = spec.entries.empty() ? first_dtype : e.target_dtype;
    s.role = e.role;
    spec.entries.push_back(std::move(s));
    options.layout_of.emplace(e.key, e.layout);
  }
  return shardcast::Plan::Build(std::move(spec), m.world_size, options);
}

void CheckAgainstOwnPlan(const shardcast::Manifest& m) {
  if (m.world_size < 1 || m.world_size > kMaxWalkedRanks || m.entries.empty() || m.entries.size() > kMaxCheckedEntries) {
    return;
  }
  for (size_t i = 0; i < m.entries.size(); ++i) {
    for (size_t j = 0; j < i; ++j) {
      if (m.entries[i].key == m.entries[j].key) return;  // a key twice: no plan has it (keys are unique)
    }
  }
  const shardcast::ManifestEntry& first = m.entries.front();
  try {
    const shardcast::Plan same = PlanOf(m, first.target_dtype);
    if (!shardcast::CheckManifest(m, same, 0, m.world_size).empty()) __builtin_trap();  // agrees with itself
    const shardcast::DType other = first.target_dtype == shardcast::DType::kBF16 ? shardcast::DType::kF32
                                                                                 : shardcast::DType::kBF16;
    const std::string problem = shardcast::CheckManifest(m, PlanOf(m, other), 0, m.world_size);
    if (problem.find("key '" + std::string(first.key) + "': dtype") != 0) __builtin_trap();  // the difference, named
  } catch (const shardcast::Error&) {
    return;  // layouts no plan holds
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  shardcast::Manifest m;
  try {
    m = shardcast::DecodeManifest(std::string(reinterpret_cast<const char*>(data), size));
  } catch (const shardcast::Error&) {
    return 0;
  }
  const std::string once = shardcast::EncodeManifest(m);
  if (shardcast::EncodeManifest(shardcast::DecodeManifest(once)) != once) __builtin_trap();
  CheckPieces(m);
  CheckAgainstOwnPlan(m);
  (void)m.MeshText();
  (void)shardcast::SourceBytes(m);
  return 0;
}
