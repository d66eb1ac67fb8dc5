#include "bench/raw_scatter.h"

#include <chrono>
#include <cstring>
#include <deque>
#include <vector>

#include "allocators/lazy_zero.h"
#include "runtime/agree/verdict.h"

namespace shardcast::bench {
namespace {

unsigned char Pattern(uint64_t offset) { return static_cast<unsigned char>(offset * 131 + 7); }

}  // namespace

ScatterResult RawScatter(Communicator& comm, uint64_t total, uint64_t chunk, int slots) {
  const int me = comm.rank(), world = comm.world_size();
  const uint64_t share = total / static_cast<uint64_t>(world);
  auto* mine = static_cast<unsigned char*>(LazyZeroAllocate(std::max<uint64_t>(share, 1)));
  comm.Barrier();
  const auto t0 = std::chrono::steady_clock::now();
  if (me == 0) {
    // Chunk c of every rank's share carries the pattern of its offset in that share.
    std::vector<std::vector<unsigned char>> ring(static_cast<size_t>(slots), std::vector<unsigned char>(chunk));
    for (auto& b : ring) {
      for (uint64_t i = 0; i < chunk; ++i) b[i] = Pattern(i);
    }
    std::deque<std::unique_ptr<PendingSend>> inflight;
    uint64_t n = 0;
    for (uint64_t off = 0; off < share; off += chunk) {
      const uint64_t len = std::min(chunk, share - off);
      std::memcpy(mine + off, ring[0].data(), len);  // rank 0's own rows: a copy into fresh memory
      for (int r = 1; r < world; ++r) {
        inflight.push_back(comm.SendAsync(ring[n++ % ring.size()].data(), len, r));
        if (inflight.size() >= static_cast<size_t>(slots - 1)) {
          inflight.front()->Wait();
          inflight.pop_front();
        }
      }
    }
    while (!inflight.empty()) {
      inflight.front()->Wait();
      inflight.pop_front();
    }
  } else {
    for (uint64_t off = 0; off < share; off += chunk) comm.Recv(mine + off, std::min(chunk, share - off), 0);
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  uint64_t wrong = 0;
  for (uint64_t i = 0; i < share; ++i) wrong += mine[i] != Pattern(i % chunk);
  LazyZeroFree(mine, std::max<uint64_t>(share, 1));
  auto all = AllGather(comm, {static_cast<int64_t>(seconds * 1e6), static_cast<int64_t>(wrong)});
  ScatterResult r;
  r.bytes = share * static_cast<uint64_t>(world);
  for (const auto& v : all) {
    r.seconds = std::max(r.seconds, v[0] / 1e6);
    r.checksum += static_cast<uint64_t>(v[1]);
  }
  return r;
}

}  // namespace shardcast::bench
