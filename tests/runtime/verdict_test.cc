// One answer for all ranks: Agree and AllGather over real Gloo ranks.
#include "runtime/agree/verdict.h"

#include <gtest/gtest.h>

#include <mutex>

#include "allocators/error.h"
#include "tests/runtime/thread_ranks.h"

namespace shardcast {
namespace {

struct Outcome {
  bool threw = false;
  ErrorKind kind = ErrorKind::kInternal;
  std::string message;
};

std::vector<Outcome> AgreeOn(int world, const std::function<Problem(int rank)>& problem) {
  std::vector<Outcome> out(world);
  testing::RunThreadRanks(world, [&](Communicator& comm) {
    Outcome& o = out[comm.rank()];
    try {
      Agree(comm, "phase", problem(comm.rank()));
    } catch (const Error& e) {
      o = {true, e.kind(), e.what()};
    }
  });
  return out;
}

TEST(Verdict, NoProblemAnywhereMeansEveryRankGoesOn) {
  for (int world : {1, 2, 3, 4}) {
    for (const Outcome& o : AgreeOn(world, [](int) { return Problem{}; })) EXPECT_FALSE(o.threw);
  }
}

TEST(Verdict, OneRanksProblemIsTheSameErrorOnEveryRank) {
  auto out = AgreeOn(4, [](int r) { return r == 2 ? Problem{ErrorKind::kCheckpoint, "file x: bad"} : Problem{}; });
  for (const Outcome& o : out) {
    ASSERT_TRUE(o.threw);
    EXPECT_EQ(o.kind, ErrorKind::kCheckpoint);
    EXPECT_EQ(o.message, out[0].message);
  }
  EXPECT_EQ(out[0].message, "phase: failed on rank 2 of 4:\n  [rank 2] file x: bad");
}

TEST(Verdict, SeveralProblemsAreListedInRankOrderWithTheLowestRanksKind) {
  auto out = AgreeOn(3, [](int r) {
    return r == 0 ? Problem{} : Problem{r == 1 ? ErrorKind::kIo : ErrorKind::kConfig, "cause " + std::to_string(r)};
  });
  for (const Outcome& o : out) {
    EXPECT_EQ(o.kind, ErrorKind::kIo);
    EXPECT_EQ(o.message, "phase: failed on ranks 1, 2 of 3:\n  [rank 1] cause 1\n  [rank 2] cause 2");
  }
}

TEST(Verdict, ALongMessageIsCutAndSaysSo) {
  auto out = AgreeOn(2, [](int r) { return r == 1 ? Problem{ErrorKind::kIo, std::string(5000, 'x')} : Problem{}; });
  EXPECT_NE(out[0].message.find("[truncated]"), std::string::npos);
  EXPECT_LT(out[0].message.size(), kVerdictSlotBytes + 100);
  EXPECT_EQ(out[0].message, out[1].message);
}

TEST(Verdict, ManyFailingRanksNameEveryRankAndShowTheFirstProblems) {
  // 70 ranks: the failing ranks' bits span two words, and rank 64's bit is the second word's first.
  const int world = 70;
  auto fails = [](int r) { return r >= 3 && r != 40; };  // 3-39, 41-69: 66 ranks
  auto out = AgreeOn(world, [&](int r) {
    return fails(r) ? Problem{r == 3 ? ErrorKind::kConfig : ErrorKind::kIo, "cause " + std::to_string(r)} : Problem{};
  });
  std::string shown;
  for (int r = 3; r < 3 + kVerdictShown; ++r) {
    shown += "\n  [rank " + std::to_string(r) + "] cause " + std::to_string(r);
  }
  for (const Outcome& o : out) {
    ASSERT_TRUE(o.threw);
    EXPECT_EQ(o.kind, ErrorKind::kConfig);
    EXPECT_EQ(o.message, "phase: failed on ranks 3-39, 41-69 of 70:" + shown +
                             "\n  (the problems of 58 more ranks are not shown)");
  }
}

TEST(Verdict, TheHighestRankOfAWordAndOfTheWorldAreFound) {
  // Bit 63 (the sign bit of the first word) and the last rank of a world that is not a multiple of 64.
  auto out = AgreeOn(66, [](int r) { return r == 63 || r == 65 ? Problem{ErrorKind::kIo, "x"} : Problem{}; });
  for (const Outcome& o : out) {
    ASSERT_TRUE(o.threw);
    EXPECT_EQ(o.message, "phase: failed on ranks 63, 65 of 66:\n  [rank 63] x\n  [rank 65] x");
  }
}

TEST(AllGather, EveryRankSeesEveryRanksValues) {
  std::mutex mu;
  std::vector<std::vector<std::vector<int64_t>>> seen(3);
  testing::RunThreadRanks(3, [&](Communicator& comm) {
    auto all = AllGather(comm, {comm.rank() * 10, -comm.rank(), 7});
    std::lock_guard<std::mutex> l(mu);
    seen[comm.rank()] = all;
  });
  for (const auto& all : seen) {
    ASSERT_EQ(all.size(), 3u);
    for (int r = 0; r < 3; ++r) EXPECT_EQ(all[r], (std::vector<int64_t>{r * 10, -r, 7}));
  }
}

TEST(RankList, RunsAreRangesAndALongListEndsWithHowManyMore) {
  EXPECT_EQ(RankList({}), "");
  EXPECT_EQ(RankList({2}), "2");
  EXPECT_EQ(RankList({2, 3}), "2, 3");
  EXPECT_EQ(RankList({3, 5, 6, 7, 8, 9}), "3, 5-9");
  std::vector<int> all(1024);
  for (int r = 0; r < 1024; ++r) all[static_cast<size_t>(r)] = r;
  EXPECT_EQ(RankList(all), "0-1023");
  std::vector<int> even;
  for (int r = 0; r < 40; r += 2) even.push_back(r);
  EXPECT_EQ(RankList(even), "0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30, and 4 more ranks");
}

}  // namespace
}  // namespace shardcast
