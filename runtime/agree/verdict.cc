#include "runtime/agree/verdict.h"

#include <cstring>

namespace shardcast {
namespace {

constexpr size_t kSlotWords = kVerdictSlotBytes / 8;

}  // namespace

void Agree(Communicator& comm, const std::string& phase, const Problem& local) {
  const int world = comm.world_size();
  // slot layout: word 0 = kind + 1 (0: no problem), words 1.. = message bytes, NUL padded
  std::vector<int64_t> buf(static_cast<size_t>(world) * kSlotWords, 0);
  if (!local.message.empty()) {
    int64_t* slot = buf.data() + static_cast<size_t>(comm.rank()) * kSlotWords;
    slot[0] = static_cast<int64_t>(local.kind) + 1;
    std::string m = local.message;
    const size_t room = kVerdictSlotBytes - 8 - 1;
    if (m.size() > room) m = m.substr(0, room - 12) + " [truncated]";
    std::memcpy(slot + 1, m.data(), m.size());
  }
  comm.AllReduceSum(buf.data(), buf.size());
  std::string message, failing;
  ErrorKind kind = ErrorKind::kInternal;
  int failed = 0;
  for (int r = 0; r < world; ++r) {
    const int64_t* slot = buf.data() + static_cast<size_t>(r) * kSlotWords;
    if (slot[0] == 0) continue;
    if (failed++ == 0) kind = static_cast<ErrorKind>(slot[0] - 1);
    const char* text = reinterpret_cast<const char*>(slot + 1);
    message += "\n  [rank " + std::to_string(r) + "] " + std::string(text, strnlen(text, kVerdictSlotBytes - 8));
    failing += (failing.empty() ? "" : ", ") + std::to_string(r);
  }
  if (failed == 0) return;
  throw Error(kind, phase, "failed on rank" + std::string(failed > 1 ? "s " : " ") + failing + " of " +
                               std::to_string(world) + ":" + message);
}

std::vector<std::vector<int64_t>> AllGather(Communicator& comm, const std::vector<int64_t>& values) {
  const size_t n = values.size();
  std::vector<int64_t> buf(static_cast<size_t>(comm.world_size()) * n, 0);
  std::memcpy(buf.data() + static_cast<size_t>(comm.rank()) * n, values.data(), n * sizeof(int64_t));
  comm.AllReduceSum(buf.data(), buf.size());
  std::vector<std::vector<int64_t>> out(comm.world_size());
  for (int r = 0; r < comm.world_size(); ++r) out[r].assign(buf.begin() + r * n, buf.begin() + (r + 1) * n);
  return out;
}

}  // namespace shardcast
