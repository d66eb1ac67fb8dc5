#include "runtime/engine/verify.h"

#include <cstdio>

#include "runtime/agree/fault.h"
#include "runtime/agree/verdict.h"

namespace shardcast {

void VerifyDigests(Communicator& comm, const Manifest& m, const StreamResult& r) {
  FaultPoint("verify", comm.rank());
  const int me = comm.rank(), world = comm.world_size();
  const size_t n = m.entries.size();
  if (n == 0) return Agree(comm, "verify", Problem{});
  // This rank sends to every rank it hashed messages for, and receives from every rank that hashed
  // what it stored: the two sides of the same messages' VerifierOf, so no rank walks another's schedule.
  std::vector<std::unique_ptr<PendingSend>> sends;
  for (int dest = 0; dest < world; ++dest) {
    const DigestColumn* col = dest == me ? nullptr : r.expected.Find(dest);
    if (col != nullptr) sends.push_back(comm.SendAsync(col->values().data(), n * sizeof(uint64_t), dest));
  }
  DigestColumn expected(n);
  if (const DigestColumn* own = r.expected.Find(me)) expected.Merge(own->values());
  std::vector<uint64_t> incoming(n);
  for (int v : r.verifiers) {
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
    const std::string key = "key '" + std::string(m.entries[i].key) + "': ";
    // each-rank: this rank and its verifier read the same bytes from their own views of the files, nothing
    // was sent between them, so their copies of the checkpoint differ (the handshake samples each file's
    // data, not all of it). Otherwise the bytes travelled from their reader: the transfer is at fault.
    if (m.params.source == Source::kEachRank) {
      local = Problem{ErrorKind::kCheckpoint, key + buf + ", reading the same bytes from its own view of the "
                      "checkpoint: the ranks' copies of it differ (ranks must load the same checkpoint)"};
    } else {
      local = Problem{ErrorKind::kComm, key + buf};
    }
    break;
  }
  Agree(comm, "verify", local);
}

}  // namespace shardcast
