// One options builder for the CLI and the binding: precedence, one size parser, bounds, and errors
// that name where a value came from.
#include "runtime/load_options.h"

#include <gtest/gtest.h>
#include <stdlib.h>

#include "allocators/units.h"
#include "tests/loaders/test_util.h"

namespace shardcast {
namespace {

using testing::Env;

TEST(LoadOptionsBuilder, DefaultsWithNothingSet) {
  LoadOptions o = LoadOptionsBuilder().Build();
  EXPECT_EQ(o.chunk_bytes, 64ull << 20);
  EXPECT_EQ(o.staging_slots, 4);
  EXPECT_EQ(o.timeout.count(), 600000);
  EXPECT_EQ(o.source, Source::kAuto);
  EXPECT_FALSE(o.verify);
}

// Read-ahead by default: a node-wide budget split over the node's readers (measured: four readers each
// 256 MiB ahead of themselves were slower cold); a value given, 0 included, applies to every reader.
TEST(LoadOptionsBuilder, ReadaheadSplitsANodeBudgetAndAGivenValueWins) {
  LoadOptions o = LoadOptionsBuilder().Build();
  EXPECT_FALSE(o.readahead_bytes.has_value());
  EXPECT_EQ(ReadaheadFor(o, 1), 256ull << 20);  // rank0, node-leader
  EXPECT_EQ(ReadaheadFor(o, 4), 64ull << 20);   // each-rank, 4 ranks on the node
  EXPECT_EQ(ReadaheadFor(o, 0), 0u);            // a node with no reader
  Env env;
  env.Set("SHARDCAST_READAHEAD_BYTES", "64MiB");
  o = LoadOptionsBuilder().FromEnvironment().Build();
  for (int readers : {1, 4, 8}) EXPECT_EQ(ReadaheadFor(o, readers), 64ull << 20);
  o = LoadOptionsBuilder().Set(Option::kReadaheadBytes, "0", "--readahead-bytes").Build();
  EXPECT_EQ(ReadaheadFor(o, 1), 0u);
}

// A CUDA target stages in 8 slots of 8 MiB with up to 8 readers (measured faster on an H100 host, see
// kCudaChunkBytes); where a chunk or a slot count is given, by flag or variable, the pair is the given value
// and the other's CPU default (no unmeasured 64 MiB x 8); CPU and pinned targets keep theirs.
TEST(LoadOptionsBuilder, ACudaTargetDefaultsToSmallerSlotsAndMoreReadersUnlessGiven) {
  LoadOptions o = LoadOptionsBuilder().Set(Option::kTarget, "cuda", "target=").Build();
  EXPECT_EQ(o.chunk_bytes, 8ull << 20);
  EXPECT_EQ(o.staging_slots, 8);
  EXPECT_EQ(ReadThreadsFor(o, 1, 16), 8);  // one GPU rank on a 16-core host
  EXPECT_EQ(ReadThreadsFor(o, 8, 16), 2);  // eight GPU ranks share 16 cores
  EXPECT_EQ(ReadThreadsFor(o, 4, 2), 1);
  o = LoadOptionsBuilder().Set(Option::kTarget, "cuda", "target=").Set(Option::kChunkBytes, "16M", "x").Build();
  EXPECT_EQ(o.chunk_bytes, 16ull << 20);
  EXPECT_EQ(o.staging_slots, 4);
  {
    Env env;
    env.Set("SHARDCAST_TARGET", "cuda");
    env.Set("SHARDCAST_STAGING_SLOTS", "6");
    o = LoadOptionsBuilder().FromEnvironment().Build();
    EXPECT_EQ(o.chunk_bytes, 64ull << 20);
    EXPECT_EQ(o.staging_slots, 6);
    EXPECT_EQ(ReadThreadsFor(o, 1, 16), 6);  // never more than the slots
  }
  for (const char* target : {"cpu", "pinned"}) {
    o = LoadOptionsBuilder().Set(Option::kTarget, target, "target=").Build();
    EXPECT_EQ(o.chunk_bytes, 64ull << 20) << target;
    EXPECT_EQ(o.staging_slots, 4) << target;
    EXPECT_EQ(ReadThreadsFor(o, 1, 16), 4) << target;
  }
}

TEST(LoadOptionsBuilder, ReadThreadsShareTheNodesCoresAndNeverExceedTheSlots) {
  LoadOptions o = LoadOptionsBuilder().Build();
  EXPECT_FALSE(o.read_threads.has_value());
  EXPECT_EQ(ReadThreadsFor(o, 1, 16), 4);  // one GPU rank on a 16-core host: capped at 4
  EXPECT_EQ(ReadThreadsFor(o, 8, 16), 2);  // eight readers share 16 cores
  EXPECT_EQ(ReadThreadsFor(o, 4, 2), 1);   // the 2-core VM at W=4: every core already busy
  EXPECT_EQ(ReadThreadsFor(o, 0, 2), 1);   // no reader on the node: this rank reads nothing
  o.staging_slots = 2;
  EXPECT_EQ(ReadThreadsFor(o, 1, 64), 2);  // one slot each
  Env env;
  env.Set("SHARDCAST_READ_THREADS", "8");
  o = LoadOptionsBuilder().FromEnvironment().Build();
  EXPECT_EQ(ReadThreadsFor(o, 4, 2), 4);  // given: 8, capped by the 4 slots
  o = LoadOptionsBuilder().Set(Option::kReadThreads, "3", "--read-threads").Set(Option::kStagingSlots, "8", "x").Build();
  EXPECT_EQ(ReadThreadsFor(o, 4, 2), 3);
  EXPECT_SC_ERROR(LoadOptionsBuilder().Set(Option::kReadThreads, "0", "--read-threads").Build(),
                  ErrorKind::kInvalidArgument, "--read-threads", "at least 1");
  EXPECT_SC_ERROR(LoadOptionsBuilder().Set(Option::kReadThreads, "65", "read_threads=").Build(),
                  ErrorKind::kInvalidArgument, "read_threads=");
}

// Regression: SHARDCAST_CHUNK_BYTES=64MiB failed while --chunk-bytes 64MiB worked (two parsers).
TEST(LoadOptionsBuilder, TheEnvironmentTakesTheSameSizesAsFlags) {
  Env env;
  env.Set("SHARDCAST_CHUNK_BYTES", "64MiB");
  env.Set("SHARDCAST_STAGING_SLOTS", "6");
  env.Set("SHARDCAST_SOURCE", "each-rank");
  env.Set("SHARDCAST_VERIFY", "true");
  LoadOptions o = LoadOptionsBuilder().FromEnvironment().Build();
  EXPECT_EQ(o.chunk_bytes, 64ull << 20);
  EXPECT_EQ(o.staging_slots, 6);
  EXPECT_EQ(o.source, Source::kEachRank);
  EXPECT_TRUE(o.verify);
}

// Regression: a bad environment value could not be overridden by a flag.
TEST(LoadOptionsBuilder, AnExplicitValueBeatsTheEnvironmentAndRepairsABadOne) {
  Env env;
  env.Set("SHARDCAST_CHUNK_BYTES", "lots");
  env.Set("SHARDCAST_STAGING_SLOTS", "8");
  LoadOptionsBuilder b;
  b.Set(Option::kChunkBytes, "1M", "--chunk-bytes");  // before FromEnvironment: still wins
  b.FromEnvironment();
  LoadOptions o = b.Build();
  EXPECT_EQ(o.chunk_bytes, 1ull << 20);
  EXPECT_EQ(o.staging_slots, 8);
  EXPECT_SC_ERROR(LoadOptionsBuilder().FromEnvironment().Build(), ErrorKind::kInvalidArgument,
                  "SHARDCAST_CHUNK_BYTES", "\"lots\" is not a size");
}

// Regression: a rank whose options failed to build (a bad SHARDCAST_TARGET) entered the agreement with the
// default timeout, and where another rank never came, waited 10 minutes after the others had given up.
TEST(LoadOptionsBuilder, TheTimeoutStandsWhereAnotherOptionFails) {
  Env env;
  env.Set("SHARDCAST_TARGET", "gpu");
  env.Set("SHARDCAST_TIMEOUT_MS", "7000");
  LoadOptionsBuilder b;
  b.FromEnvironment();
  EXPECT_SC_ERROR(b.Build(), ErrorKind::kInvalidArgument, "SHARDCAST_TARGET", "is not a target");
  EXPECT_EQ(b.Timeout().count(), 7000);
  b.Set(Option::kTimeoutMs, "5000", "timeout_ms=");  // given beats the environment, as in Build
  EXPECT_EQ(b.Timeout().count(), 5000);
  b.Set(Option::kTimeoutMs, "soon", "timeout_ms=");  // itself bad: the default, never an exception
  EXPECT_EQ(b.Timeout().count(), 600000);
}

TEST(LoadOptionsBuilder, BoundsAreErrorsNamingTheOriginNeverSilentlyIgnored) {
  auto fails = [](Option opt, const char* value, const char* origin, const char* why) {
    EXPECT_SC_ERROR(LoadOptionsBuilder().Set(opt, value, origin).Build(), ErrorKind::kInvalidArgument, origin, why);
  };
  fails(Option::kStagingSlots, "1000000000", "--staging-slots", "exceeds the limit of 64");
  fails(Option::kStagingSlots, "-3", "--staging-slots", "not a non-negative integer");
  fails(Option::kStagingSlots, "1", "--staging-slots", "below 2");
  fails(Option::kTimeoutMs, "-5", "--timeout-ms", "not a non-negative integer");
  fails(Option::kTimeoutMs, "0", "timeout_ms=", "at least 1 ms");
  fails(Option::kChunkBytes, "1e30", "--chunk-bytes", "unknown unit \"e30\"");
  fails(Option::kChunkBytes, "nan", "--chunk-bytes", "is not a size");
  fails(Option::kChunkBytes, "100", "--chunk-bytes", "below the minimum");
  fails(Option::kChunkBytes, "5G", "--chunk-bytes", "exceeds the limit");
  fails(Option::kSource, "rank1", "--source", "rank0, each-rank, node-leader or striped");
  fails(Option::kVerify, "maybe", "verify=", "not a boolean");
  fails(Option::kWeightBlockSize, "0", "weight_block_size=", "at least 1");
  fails(Option::kWeightBlockSize, "128x0", "weight_block_size=", "at least 1");
  fails(Option::kWeightBlockSize, "x128", "weight_block_size=", "N or RxC");
  fails(Option::kWeightBlockSize, "128x", "weight_block_size=", "N or RxC");
  fails(Option::kWeightBlockSize, "12y", "weight_block_size=", "not a non-negative integer");
  fails(Option::kWeightBlockSize, "2000000", "weight_block_size=", "exceeds the limit");
}

TEST(LoadOptionsBuilder, AWeightBlockIsNOrRowsByColumnsAndUnsetByDefault) {
  EXPECT_FALSE(LoadOptionsBuilder().Build().weight_block.has_value());
  const LoadOptions square = LoadOptionsBuilder().Set(Option::kWeightBlockSize, "120", "t").Build();
  ASSERT_TRUE(square.weight_block.has_value());
  EXPECT_EQ(square.weight_block->rows, 120u);
  EXPECT_EQ(square.weight_block->cols, 120u);
  const LoadOptions oblong = LoadOptionsBuilder().Set(Option::kWeightBlockSize, "128x64", "t").Build();
  EXPECT_EQ(oblong.weight_block->rows, 128u);
  EXPECT_EQ(oblong.weight_block->cols, 64u);
}

TEST(ParseBytes, OneGrammarForEveryOrigin) {
  EXPECT_EQ(ParseBytes("4096"), 4096u);
  EXPECT_EQ(ParseBytes("64M"), 64ull << 20);
  EXPECT_EQ(ParseBytes("64MiB"), 64ull << 20);
  EXPECT_EQ(ParseBytes("1.5G"), 3ull << 29);
  EXPECT_EQ(ParseBytes("2GB"), 2000000000u);
  EXPECT_EQ(ParseBytes("0.5K"), 512u);
  EXPECT_EQ(ParseBytes("7B"), 7u);
  for (const char* bad : {"", "M", "-1", "+1", "1e3", "nan", "inf", " 1", "1 M", "1.2.3", "0x10", "1MiBs"}) {
    EXPECT_SC_ERROR(ParseBytes(bad, "X"), ErrorKind::kInvalidArgument, "X");
  }
  EXPECT_SC_ERROR(ParseBytes("99999999999999999999"), ErrorKind::kInvalidArgument, "exceeds the limit");
  EXPECT_SC_ERROR(ParseBytes("20000000T"), ErrorKind::kInvalidArgument, "exceeds the limit");
  EXPECT_EQ(ParseCount("42", "n", 42), 42u);
  EXPECT_SC_ERROR(ParseCount("43", "n", 42), ErrorKind::kInvalidArgument, "exceeds the limit of 42");
}

}  // namespace
}  // namespace shardcast
