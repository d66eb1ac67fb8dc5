#include "runtime/agree/verdict.h"

#include <algorithm>
#include <cstring>

namespace shardcast {
namespace {

constexpr size_t kSlotWords = kVerdictSlotBytes / 8;

bool BitSet(const std::vector<int64_t>& bits, int r) { return (static_cast<uint64_t>(bits[r / 64]) >> (r % 64)) & 1u; }

}  // namespace

std::string RankList(const std::vector<int>& ranks) {
  std::string out;
  int items = 0;
  const auto add = [&](const std::string& s) { out += (out.empty() ? "" : ", ") + s; };
  for (size_t i = 0; i < ranks.size();) {
    if (items == kRankListItems) {
      const size_t left = ranks.size() - i;
      add("and " + std::to_string(left) + " more rank" + (left > 1 ? "s" : ""));
      break;
    }
    size_t j = i;
    while (j + 1 < ranks.size() && ranks[j + 1] == ranks[j] + 1) ++j;
    if (j - i >= 2) {
      add(std::to_string(ranks[i]) + "-" + std::to_string(ranks[j]));
      j = j + 1;
    } else {
      j = i + 1;  // one rank a step: a pair is two items
      add(std::to_string(ranks[i]));
    }
    ++items;
    i = j;
  }
  return out;
}

std::string RanksText(const std::vector<int>& ranks) {
  return ranks.empty() ? "" : (ranks.size() == 1 ? "rank " : "ranks ") + RankList(ranks);
}

void Agree(Communicator& comm, const std::string& phase, const Problem& local) {
  const int world = comm.world_size(), rank = comm.rank();
  const bool failing = !local.message.empty();
  // 1. Who failed: rank r's bit, set by rank r alone, so the sum never carries.
  std::vector<int64_t> bits(static_cast<size_t>(world + 63) / 64, 0);
  if (failing) bits[rank / 64] = static_cast<int64_t>(uint64_t{1} << (rank % 64));
  comm.AllReduceSum(bits.data(), bits.size());
  std::vector<int> failed;
  for (int r = 0; r < world; ++r) {
    if (BitSet(bits, r)) failed.push_back(r);
  }
  if (failed.empty()) return;
  // 2. The first kVerdictShown failing ranks' problems. Slot layout: word 0 = kind + 1, words 1.. = the
  // message's bytes, NUL padded.
  const size_t shown = std::min(failed.size(), static_cast<size_t>(kVerdictShown));
  std::vector<int64_t> slots(shown * kSlotWords, 0);
  const size_t mine = std::lower_bound(failed.begin(), failed.end(), rank) - failed.begin();
  if (failing && mine < shown) {
    int64_t* slot = slots.data() + mine * kSlotWords;
    slot[0] = static_cast<int64_t>(local.kind) + 1;
    std::string m = local.message;
    const size_t room = kVerdictSlotBytes - 8 - 1;
    if (m.size() > room) m = m.substr(0, room - 12) + " [truncated]";
    std::memcpy(slot + 1, m.data(), m.size());
  }
  comm.AllReduceSum(slots.data(), slots.size());
  std::vector<std::string> messages;
  for (size_t i = 0; i < shown; ++i) {
    const char* text = reinterpret_cast<const char*>(slots.data() + i * kSlotWords + 1);
    messages.emplace_back(text, strnlen(text, kVerdictSlotBytes - 8));
  }
  throw Error(static_cast<ErrorKind>(slots[0] - 1), phase, VerdictText(failed, messages, world));
}

std::string VerdictText(const std::vector<int>& failed, const std::vector<std::string>& messages, int world) {
  std::string text = "failed on rank" + std::string(failed.size() > 1 ? "s " : " ") + RankList(failed) + " of " +
                     std::to_string(world) + ":";
  const size_t shown = std::min(messages.size(), failed.size());
  for (size_t i = 0; i < shown; ++i) text += "\n  [rank " + std::to_string(failed[i]) + "] " + messages[i];
  if (failed.size() > shown) {
    text += "\n  (the problems of " + std::to_string(failed.size() - shown) + " more ranks are not shown)";
  }
  return text;
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
