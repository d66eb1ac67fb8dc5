#include "runtime/verify.h"

#include <algorithm>
#include <cstdio>
#include <set>

#include "runtime/fault.h"
#include "runtime/verdict.h"

namespace shardcast {

namespace {

// For every rank, the ranks whose reads hash expected digests for it: one walk of the schedule, the
// same on every rank.
std::vector<std::vector<int>> Verifiers(const Manifest& m, const Route& route) {
  const int world = route.world_size();
  std::vector<std::set<int>> sets(world);
  Schedule schedule(m);
  Message msg;
  while (schedule.Next(&msg)) {
    for (int r = 0; r < world; ++r) {
      for (int d : route.For(msg, r, true).verify_for) sets[d].insert(r);
    }
  }
  std::vector<std::vector<int>> out(world);
  for (int d = 0; d < world; ++d) out[d].assign(sets[d].begin(), sets[d].end());
  return out;
}

}  // namespace

void VerifyDigests(Communicator& comm, const Manifest& m, const Route& route, const StreamResult& r) {
  FaultPoint("verify", comm.rank());
  const int me = comm.rank(), world = comm.world_size();
  const size_t n = m.entries.size();
  if (n == 0) return Agree(comm, "verify", Problem{});
  const std::vector<uint64_t> zeros(n, 0);
  const std::vector<std::vector<int>> verifiers = Verifiers(m, route);
  std::vector<std::unique_ptr<PendingSend>> sends;
  for (int dest = 0; dest < world; ++dest) {
    if (dest == me) continue;
    const auto& v = verifiers[dest];  // every rank derives the same lists
    if (std::find(v.begin(), v.end(), me) == v.end()) continue;
    const DigestColumn* col = r.expected.Find(dest);
    const std::vector<uint64_t>& values = col ? col->values() : zeros;
    sends.push_back(comm.SendAsync(values.data(), n * sizeof(uint64_t), dest));
  }
  DigestColumn expected(n);
  if (const DigestColumn* own = r.expected.Find(me)) expected.Merge(own->values());
  std::vector<uint64_t> incoming(n);
  for (int v : verifiers[me]) {
    if (v == me) continue;
    comm.Recv(incoming.data(), n * sizeof(uint64_t), v);
    expected.Merge(incoming);
  }
  for (auto& s : sends) s->Wait();
  Problem local;
  for (size_t i = 0; i < n; ++i) {
    const uint64_t want = expected.values()[i], got = r.held.values()[i];
    if (want == got) continue;
    char buf[200];
    std::snprintf(buf, sizeof(buf), "checksum %016llx on rank %d, but its verifier's is %016llx",
                  static_cast<unsigned long long>(got), me, static_cast<unsigned long long>(want));
    local = Problem{ErrorKind::kComm, "key '" + m.entries[i].key + "': " + buf};
    break;
  }
  Agree(comm, "verify", local);
}

}  // namespace shardcast
