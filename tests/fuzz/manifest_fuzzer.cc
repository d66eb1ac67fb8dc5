// libFuzzer target: DecodeManifest, the decoder every rank runs on the bytes rank 0 broadcasts. Any
// input must either decode or throw shardcast::Error; anything else (crash, sanitizer report, other
// exception, a hang) is a bug. What is accepted must keep the contract:
//   - re-encoding is stable: Encode(Decode(Encode(m))) == Encode(m) for the decoded m (the decoder
//     normalizes, e.g. an empty part key to the entry's, so the first re-encoding may differ from the input);
//   - every entry's layout describes its shape: each rank's piece, walked as strided runs (what the
//     schedule and the sinks do with it), covers exactly piece.numel() elements, every run inside the
//     global tensor and inside the local one.
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "allocators/error.h"
#include "runtime/layout.h"
#include "runtime/manifest.h"

namespace {

// Walks of bigger tensors or worlds prove nothing more and would only slow the fuzzer down.
constexpr uint64_t kMaxWalkedElements = 1 << 16;
constexpr int kMaxWalkedRanks = 16;
constexpr size_t kMaxWalkedEntries = 8;

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
  (void)m.MeshText();
  (void)shardcast::SourceBytes(m);
  return 0;
}
