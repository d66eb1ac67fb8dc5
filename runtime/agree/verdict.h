// runtime/agree/verdict: one answer for all ranks.
//
// Agree: every rank passes its local problem (empty if none). Either every rank returns, or every rank
// throws the same Error: the kind of the lowest failing rank, a message naming every failing rank and
// the problems of the first kVerdictShown of them in rank order. Two all-reduces carry it, both of a
// size that does not grow with the world size times itself:
//   1. who failed: one bit a rank (W / 64 words); each rank sets its own bit, so the sum is the union.
//      No bit set: every rank returns (the common case: 8 bytes at W <= 64, 128 bytes at W = 1,024).
//   2. only where a bit is set: kVerdictShown slots of kVerdictSlotBytes; the i-th failing rank writes
//      its kind and message into slot i (i < kVerdictShown), and the sum gives every rank every slot.
// Before, one all-reduce of W slots (W KiB a rank) carried the verdict: at W = 256 on one host most of
// the handshake's time (bench/bench_gloo_group.cc).
//
// AllGather: the same slot trick for a few int64s per rank (reports, counters).
#pragma once

#include <string>
#include <vector>

#include "runtime/agree/communicator.h"

namespace shardcast {

inline constexpr size_t kVerdictSlotBytes = 1024;  // a longer message is cut, and says so
inline constexpr int kVerdictShown = 8;           // failing ranks whose messages the error carries

struct Problem {
  ErrorKind kind = ErrorKind::kManifestMismatch;
  std::string message;  // empty: no problem
};

void Agree(Communicator& comm, const std::string& phase, const Problem& local);

// "1, 2", "0-1023", "3, 5-9": ranks in ascending order, a run of three or more as a range, at most
// kRankListItems items, then "and N more ranks"; what every error that names several ranks says.
inline constexpr int kRankListItems = 16;
std::string RankList(const std::vector<int>& ranks);
// The same with its noun: "rank 2", "ranks 2, 5", "ranks 0-11"; "" for none.
std::string RanksText(const std::vector<int>& ranks);
// A verdict's words: "failed on rank(s) <RankList(failed)> of <world>:", then "\n  [rank r] <message>" for the
// first messages.size() of `failed` (ascending), then how many more failed unshown. Agree raises it; Python's
// from_pretrained raises the same words for its first exchange (binding: verdict_text).
std::string VerdictText(const std::vector<int>& failed, const std::vector<std::string>& messages, int world);

// values: this rank's n values. Returns world_size rows of n values, row r from rank r.
std::vector<std::vector<int64_t>> AllGather(Communicator& comm, const std::vector<int64_t>& values);

}  // namespace shardcast
