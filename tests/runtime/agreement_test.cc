// Decide on one rank, share, check everywhere, agree: DecideAndAgree over real Gloo ranks, with a
// problem entering at every step and on every rank (rank 0 included). No case may hang: each either
// returns on every rank or raises the same error on every rank.
#include "runtime/agree/agreement.h"

#include <gtest/gtest.h>

#include <chrono>
#include <thread>

#include "allocators/error.h"
#include "tests/runtime/thread_ranks.h"

namespace shardcast {
namespace {

struct Outcome {
  bool threw = false;
  std::string message;
  std::string decision;  // what check saw ("" if it did not run)
  int64_t facts_sum = 0;
};

struct Faults {
  int enters_failed = -1;  // this rank enters with a problem
  bool decide_throws = false;
  int check_throws = -1;   // this rank's check throws
};

std::vector<Outcome> RunRanks(int world, const Faults& f) {
  std::vector<Outcome> out(world);
  testing::RunThreadRanks(world, [&](Communicator& comm) {
    const int me = comm.rank();
    Outcome& o = out[me];
    Deciding d;
    d.phase = "phase";
    d.facts = {me + 1, 10 * me};
    d.decide = [&](const Facts& facts) {
      if (f.decide_throws) throw Error(ErrorKind::kCheckpoint, "file.safetensors", "bad header");
      int64_t sum = 0;
      for (const auto& row : facts) sum += row[0];
      return "decided " + std::to_string(sum);
    };
    d.check = [&](const std::string& decision, const Facts& facts) {
      o.decision = decision;
      for (const auto& row : facts) o.facts_sum += row[1];
      if (me == f.check_throws) throw Error(ErrorKind::kManifestMismatch, "", "key 'w': other layout");
    };
    Problem mine;
    if (me == f.enters_failed) mine = {ErrorKind::kConfig, "no plan"};
    try {
      DecideAndAgree(comm, d, mine);
    } catch (const Error& e) {
      o.threw = true;
      o.message = e.what();
    }
  });
  return out;
}

TEST(Agreement, EveryRankChecksRankZerosDecisionAndGoesOn) {
  for (int world : {1, 2, 3, 4}) {
    const auto out = RunRanks(world, {});
    const int64_t n = world * (world + 1) / 2;
    for (const Outcome& o : out) {
      EXPECT_FALSE(o.threw) << o.message;
      EXPECT_EQ(o.decision, "decided " + std::to_string(n));
      EXPECT_EQ(o.facts_sum, 10 * (n - world));
    }
  }
}

TEST(Agreement, ARankThatEntersFailedIsTheSameErrorEverywhereAndChecksNothing) {
  for (int failed : {0, 2}) {
    const auto out = RunRanks(3, {.enters_failed = failed});
    for (const Outcome& o : out) {
      ASSERT_TRUE(o.threw);
      EXPECT_EQ(o.message, "phase: failed on rank " + std::to_string(failed) + " of 3:\n  [rank " +
                               std::to_string(failed) + "] no plan");
    }
    EXPECT_EQ(out[failed].decision, "");
    if (failed != 0) {
      EXPECT_EQ(out[0].decision, "decided 6");  // the others still checked
    }
  }
}

TEST(Agreement, RankZerosFailedDecisionIsEveryRanksErrorAndNobodyChecks) {
  const auto out = RunRanks(4, {.decide_throws = true});
  for (const Outcome& o : out) {
    ASSERT_TRUE(o.threw);
    EXPECT_EQ(o.message, "phase: failed on rank 0 of 4:\n  [rank 0] file.safetensors: bad header");
    EXPECT_EQ(o.decision, "");
  }
}

TEST(Agreement, OneRanksFailedCheckIsEveryRanksError) {
  const auto out = RunRanks(4, {.check_throws = 3});
  for (const Outcome& o : out) {
    ASSERT_TRUE(o.threw);
    EXPECT_EQ(o.message, "phase: failed on rank 3 of 4:\n  [rank 3] key 'w': other layout");
  }
}

TEST(Agreement, ProblemsOnSeveralRanksAreListedTogether) {
  const auto out = RunRanks(3, {.enters_failed = 1, .check_throws = 2});
  for (const Outcome& o : out) {
    ASSERT_TRUE(o.threw);
    EXPECT_EQ(o.message, "phase: failed on ranks 1, 2 of 3:\n  [rank 1] no plan\n  [rank 2] key 'w': other layout");
  }
}

}  // namespace
}  // namespace shardcast

namespace shardcast {
namespace {

// Rank 0 frozen before the phase: the others' collectives time out. A rank that entered with its own
// problem (say, rank 0's keys never arrived) names it in the timeout error, since it is the cause.
TEST(Agreement, ATimeoutCarriesTheProblemThisRankEnteredWith) {
  std::vector<std::string> messages(3);
  std::vector<ErrorKind> kinds(3, ErrorKind::kInternal);
  testing::RunThreadRanks(
      3,
      [&](Communicator& comm) {
        const int me = comm.rank();
        if (me == 0) {
          std::this_thread::sleep_for(std::chrono::milliseconds(3000));  // never enters the phase
          return;
        }
        Deciding d;
        d.phase = "handshake";
        d.facts = {me};
        d.decide = [](const Facts&) { return std::string("x"); };
        d.check = [](const std::string&, const Facts&) {};
        Problem mine;
        if (me == 1) mine = {ErrorKind::kInternal, "rank 0's keys did not arrive within 1 s"};
        try {
          DecideAndAgree(comm, d, mine);
        } catch (const Error& e) {
          kinds[me] = e.kind();
          messages[me] = e.what();
        }
      },
      std::chrono::milliseconds(1000));
  for (int r : {1, 2}) {
    EXPECT_TRUE(kinds[r] == ErrorKind::kCommTimeout || kinds[r] == ErrorKind::kComm) << messages[r];
  }
  EXPECT_NE(messages[1].find("this rank's own failure, which the handshake was to share: rank 0's keys did not "
                             "arrive within 1 s"),
            std::string::npos)
      << messages[1];
  EXPECT_EQ(messages[2].find("own failure"), std::string::npos) << messages[2];
}

}  // namespace
}  // namespace shardcast
