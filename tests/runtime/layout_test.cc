// Layouts: the header's worked examples, coverage of every element exactly once per replica over random
// layouts (mesh dims 1-3, sizes 1-8, every placement, uneven and empty pieces), and the schedule's
// segments landing each element at its local place, checked against an independent index walk.
#include "runtime/layout/layout.h"

#include <gtest/gtest.h>

#include <map>
#include <random>

#include "allocators/error.h"
#include "runtime/stream/schedule.h"

namespace shardcast {
namespace {

Placement S(int d) { return Placement{Placement::kShard, d, 1}; }
Placement SS(int d, uint32_t sf) { return Placement{Placement::kStridedShard, d, sf}; }
Placement R() { return Placement{}; }

std::vector<int> Ranks(int n) {
  std::vector<int> r;
  for (int i = 0; i < n; ++i) r.push_back(i);
  return r;
}

std::vector<std::vector<Span>> Spans(std::initializer_list<std::vector<Span>> dims) { return dims; }

TEST(Layout, Shard0IsTorchChunkWithEmptyTrailingRanks) {
  const Layout l{{4}, Ranks(4), {S(0)}, {}};
  EXPECT_EQ(PieceOf({5, 3}, l, 0).dims, Spans({{{0, 2}}, {{0, 3}}}));
  EXPECT_EQ(PieceOf({5, 3}, l, 2).dims, Spans({{{4, 5}}, {{0, 3}}}));
  EXPECT_EQ(PieceOf({5, 3}, l, 3).numel(), 0u);
  EXPECT_EQ(PieceOf({5, 3}, l, 3).LocalShape(), (std::vector<uint64_t>{0, 3}));
}

TEST(Layout, Shard1GivesOneRunPerRow) {
  const Piece p = PieceOf({4, 6}, Layout{{4}, Ranks(4), {S(1)}, {}}, 1);
  EXPECT_EQ(p.LocalShape(), (std::vector<uint64_t>{4, 2}));
  std::vector<StridedRuns> runs;
  ForEachRuns(std::vector<uint64_t>{4, 6}, p, [&](const StridedRuns& r) { runs.push_back(r); });
  ASSERT_EQ(runs.size(), 1u);
  EXPECT_EQ(runs[0].first, 2u);
  EXPECT_EQ(runs[0].count, 2u);
  EXPECT_EQ(runs[0].runs, 4u);
  EXPECT_EQ(runs[0].stride, 6u);
  EXPECT_EQ(runs[0].local_stride, 2u);
}

TEST(Layout, HsdpReplicasHoldTheSameRows) {
  const Layout l{{2, 3}, Ranks(6), {R(), S(0)}, {}};
  const auto h = Holdings({7}, l, 6);
  ASSERT_EQ(h.size(), 3u);
  EXPECT_EQ(h[0].holders, (std::vector<int>{0, 3}));
  EXPECT_EQ(h[2].holders, (std::vector<int>{2, 5}));
  EXPECT_EQ(h[2].piece.dims, Spans({{{6, 7}}}));
}

TEST(Layout, StridedShardIsFsdpOverTp) {
  const Layout l{{2, 2}, Ranks(4), {SS(0, 2), S(0)}, {}};  // (dp, tp)
  EXPECT_EQ(PieceOf({8, 4}, l, 0).dims[0], (std::vector<Span>{{0, 2}}));
  EXPECT_EQ(PieceOf({8, 4}, l, 1).dims[0], (std::vector<Span>{{4, 6}}));
  EXPECT_EQ(PieceOf({8, 4}, l, 2).dims[0], (std::vector<Span>{{2, 4}}));
  EXPECT_EQ(PieceOf({8, 4}, l, 3).dims[0], (std::vector<Span>{{6, 8}}));
  // Alone on 4 ranks, 9 rows: halves [0,5) [5,9), each in 4 chunks; a piece is two spans.
  const Layout alone{{4}, Ranks(4), {SS(0, 2)}, {}};
  EXPECT_EQ(PieceOf({9}, alone, 0).dims[0], (std::vector<Span>{{0, 2}, {5, 6}}));
  EXPECT_EQ(PieceOf({9}, alone, 2).dims[0], (std::vector<Span>{{4, 5}, {7, 8}}));
  EXPECT_EQ(PieceOf({9}, alone, 3).dims[0], (std::vector<Span>{{8, 9}}));
}

// Regression (found by the manifest fuzzer, a 12 s timeout): a _StridedShard cost its split factor
// times the spans an earlier placement left, and a split factor far past the dim's length cost the split
// factor itself. Before the fix the first layout below took 2^18 x 2^19 span visits per rank (hours),
// the second 2^32 chunk steps; now each is linear in the spans.
TEST(Layout, StridedShardOverManySpansOrPastTheLengthIsLinear) {
  const uint64_t n = 1 << 20;
  const Layout twice{{2, 2}, Ranks(4), {SS(0, 1 << 19), SS(0, 1 << 18)}, {}};
  for (int rank = 0; rank < 4; ++rank) {
    // The first placement keeps every other element (odd ones for mesh row 1), the second every other
    // of those (mesh column 1: the second of each pair): rank r holds the elements 4i + (2 * col + row).
    const uint64_t residue = 2 * static_cast<uint64_t>(rank % 2) + static_cast<uint64_t>(rank / 2);
    const std::vector<Span> spans = PieceOf({n}, twice, rank).dims[0];
    ASSERT_EQ(spans.size(), n / 4) << "rank " << rank;
    for (uint64_t i = 0; i < spans.size(); ++i) {
      ASSERT_EQ(spans[i], (Span{4 * i + residue, 4 * i + residue + 1})) << "rank " << rank << ", span " << i;
    }
  }
  const Layout past{{2}, Ranks(2), {SS(0, UINT32_MAX)}, {}};  // chunks of one element, each to mesh rank 0
  EXPECT_EQ(PieceOf({4}, past, 0).dims[0], (std::vector<Span>{{0, 4}}));
  EXPECT_EQ(PieceOf({4}, past, 1).numel(), 0u);
}

TEST(Layout, ARankOutsideTheMeshHoldsNothing) {
  const Layout l{{2}, {3, 1}, {S(0)}, {}};  // a mesh of its own, in another order
  EXPECT_FALSE(PieceOf({4}, l, 0).held);
  EXPECT_EQ(PieceOf({4}, l, 3).dims[0], (std::vector<Span>{{0, 2}}));
  EXPECT_EQ(PieceOf({4}, l, 1).dims[0], (std::vector<Span>{{2, 4}}));
}

TEST(Layout, BadLayoutsNameWhatIsWrong) {
  EXPECT_THROW(Layout({{2}, {0}, {S(0)}, {}}).Check({4}, "k"), Error);
  EXPECT_THROW(Layout({{2}, {0, 0}, {S(0)}, {}}).Check({4}, "k"), Error);
  EXPECT_THROW(Layout({{2}, {0, 1}, {S(1)}, {}}).Check({4}, "k"), Error);
  EXPECT_THROW(Layout({{2}, {0, 1}, {SS(0, 0)}, {}}).Check({4}, "k"), Error);
  EXPECT_NO_THROW(Layout({{2, 1}, {0, 1}, {S(0), S(0)}, {}}).Check({4}, "k"));
}

TEST(Layout, ExplicitBoxesAreWhatEachRankDeclared) {
  // The header's example: [4, 6] over 3 ranks.
  Layout l;
  l.ranks = {0, 1, 2};
  l.boxes = {Box{{0, 0}, {4, 2}}, Box{{0, 2}, {2, 4}}, Box{{2, 2}, {2, 4}}};
  l.Check({4, 6}, "w");
  EXPECT_FALSE(l.replicated());
  EXPECT_EQ(PieceOf({4, 6}, l, 0).dims, (std::vector<std::vector<Span>>{{{0, 4}}, {{0, 2}}}));
  EXPECT_EQ(PieceOf({4, 6}, l, 2).dims, (std::vector<std::vector<Span>>{{{2, 4}}, {{2, 6}}}));
  EXPECT_FALSE(PieceOf({4, 6}, l, 3).held);  // not listed: holds nothing
  EXPECT_EQ(l.Text(), "boxes over ranks [0, 1, 2]: rank 0 [0:4, 0:2], rank 1 [0:2, 2:6], rank 2 [2:4, 2:6]");
  EXPECT_EQ(Holdings({4, 6}, l, 3).size(), 3u);
}

// Regression (found by the manifest fuzzer, a heap-buffer-overflow under ASan): the error for more boxes
// than ranks named the layout by its text, which read a rank for every box.
TEST(Layout, MoreBoxesThanRanksIsRefusedWithoutReadingPastTheRanks) {
  Layout l;
  l.ranks = {3};
  l.boxes = {Box{{0}, {2}}, Box{{2}, {2}}};
  try {
    l.Check({4}, "w");
    ADD_FAILURE() << "accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("rank 3 [0:2], rank ? [2:4]: one rank per box is needed"), std::string::npos)
        << e.what();
  }
}

TEST(Layout, ABoxOutsideTheTensorOrOfAnotherRankIsRefusedByName) {
  Layout l;
  l.ranks = {0, 1};
  l.boxes = {Box{{0, 0}, {4, 2}}, Box{{3, 2}, {2, 4}}};
  try {
    l.Check({4, 6}, "key 'w'");
    FAIL() << "a box past dim 0 was taken";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("key 'w'"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("rank 1's box reaches 3 + 2 in dim 0 of size 4"), std::string::npos) << e.what();
  }
  l.boxes[1] = Box{{0}, {1}};
  EXPECT_THROW(l.Check({4, 6}, "w"), Error);  // one dim for a 2-d tensor
  l.boxes[1] = Box{{0, 0}, {1, 1}};
  l.mesh_shape = {2};
  EXPECT_THROW(l.Check({4, 6}, "w"), Error);  // boxes and a mesh
}

// A random layout over `world` ranks for a tensor of `nd` dims.
Layout RandomLayout(std::mt19937& rng, int world, size_t nd) {
  Layout l;
  const int dims = 1 + static_cast<int>(rng() % 3);
  int left = world;
  for (int d = 0; d < dims; ++d) {
    int size = d + 1 == dims ? left : 1;
    if (d + 1 < dims) {
      std::vector<int> divisors;
      for (int k = 1; k <= left; ++k) {
        if (left % k == 0) divisors.push_back(k);
      }
      size = divisors[rng() % divisors.size()];
    }
    left /= size;
    l.mesh_shape.push_back(static_cast<uint32_t>(size));
    const int kind = nd == 0 ? 0 : static_cast<int>(rng() % 3);
    const int tdim = nd == 0 ? 0 : static_cast<int>(rng() % nd);
    l.placements.push_back(kind == 0 ? R() : kind == 1 ? S(tdim) : SS(tdim, 1 + rng() % 3));
  }
  l.ranks = Ranks(world);
  std::shuffle(l.ranks.begin(), l.ranks.end(), rng);
  return l;
}

// Random explicit boxes: each rank (in a random order, some ranks left out) one box of `shape`, empty
// ones included; boxes may overlap or leave elements to nobody.
Layout RandomBoxes(std::mt19937& rng, int world, const std::vector<uint64_t>& shape) {
  Layout l;
  for (int r : Ranks(world)) {
    if (rng() % 5 == 0) continue;  // a rank that holds nothing
    Box b;
    for (uint64_t n : shape) {
      const uint64_t at = n ? rng() % (n + 1) : 0;
      b.offset.push_back(at);
      b.size.push_back(n - at ? rng() % (n - at + 1) : 0);
    }
    l.ranks.push_back(r);
    l.boxes.push_back(b);
  }
  if (l.boxes.empty()) l.ranks.push_back(0), l.boxes.push_back(Box{std::vector<uint64_t>(shape.size(), 0), shape});
  std::shuffle(l.ranks.begin(), l.ranks.end(), rng);
  return l;
}

uint64_t Numel(const std::vector<uint64_t>& s) {
  uint64_t n = 1;
  for (uint64_t d : s) n *= d;
  return n;
}

// The global element at each local position of a piece, by plain index arithmetic over its spans.
std::vector<uint64_t> Expected(const std::vector<uint64_t>& shape, const Piece& p) {
  const std::vector<uint64_t> ls = p.LocalShape();
  std::vector<uint64_t> out(Numel(ls));
  std::vector<std::vector<uint64_t>> index(shape.size());  // local index -> global index, per dim
  for (size_t d = 0; d < shape.size(); ++d) {
    for (const Span& s : p.dims[d]) {
      for (uint64_t g = s.begin; g < s.end; ++g) index[d].push_back(g);
    }
  }
  for (uint64_t flat = 0; flat < out.size(); ++flat) {
    uint64_t rest = flat, global = 0, stride = 1;
    for (size_t d = shape.size(); d-- > 0;) {
      global += index[d][rest % ls[d]] * stride;
      rest /= ls[d];
      stride *= shape[d];
    }
    out[flat] = global;
  }
  return out;
}

class LayoutProperty : public ::testing::TestWithParam<int> {};

TEST_P(LayoutProperty, EveryElementIsHeldOncePerReplicaAndTheScheduleLandsItInPlace) {
  std::mt19937 rng(1234 + GetParam());
  for (int trial = 0; trial < 60; ++trial) {
    const int world = 1 + static_cast<int>(rng() % 8);
    const size_t nd = rng() % 4;
    std::vector<uint64_t> shape;
    for (size_t d = 0; d < nd; ++d) shape.push_back(rng() % 9);  // sizes 0-8: uneven, empty pieces
    const bool explicit_boxes = rng() % 4 == 0;
    const Layout l = explicit_boxes ? RandomBoxes(rng, world, shape) : RandomLayout(rng, world, nd);
    l.Check(shape, "property");
    SCOPED_TRACE(l.Text() + " on a tensor of " + std::to_string(nd) + " dims, world " + std::to_string(world));
    int replicas = 1;
    for (size_t m = 0; m < l.placements.size(); ++m) {
      if (l.placements[m].kind == Placement::kReplicate) replicas *= static_cast<int>(l.mesh_shape[m]);
    }
    // Coverage: each element once per replica.
    std::vector<int> held(Numel(shape), 0);
    std::map<int, std::vector<uint64_t>> expected;
    for (int r = 0; r < world; ++r) {
      const Piece p = PieceOf(shape, l, r);
      expected[r] = p.held ? Expected(shape, p) : std::vector<uint64_t>{};
      for (uint64_t g : expected[r]) ++held[g];
    }
    for (size_t g = 0; g < held.size() && !explicit_boxes; ++g) ASSERT_EQ(held[g], replicas) << "element " << g;

    // The schedule over a two-part composed entry, tiny chunks: every holder's local tensor gets the
    // global index of each of its elements, exactly once.
    Manifest m;
    m.world_size = world;
    m.params.chunk_bytes = 4 + rng() % 40;
    m.params.coalesce_bytes = rng() % 32;
    m.layouts = {l};
    ManifestEntry e;
    e.key = "w";
    e.target_dtype = DType::kF32;
    e.shape = m.KeepShape(shape);
    const uint64_t n = Numel(shape), cut = n / 2;
    for (uint64_t part_n : {cut, n - cut}) {
      ManifestPart part;
      part.source_dtype = DType::kF32;
      part.numel = part_n;
      part.shape = m.KeepShape({part_n});
      e.parts.push_back(part);
    }
    m.entries.push_back(e);
    std::map<int, std::vector<int64_t>> local;
    for (int r = 0; r < world; ++r) local[r].assign(expected[r].size(), -1);
    Schedule s(m);
    Message msg;
    while (s.Next(&msg)) {
      const std::vector<int> holders = msg.dest == kBroadcast ? Ranks(world) : *msg.holders;
      for (const Segment& seg : msg.segments) {
        const uint64_t base = seg.part == 0 ? 0 : cut;
        for (int h : holders) {
          for (uint64_t i = 0; i < seg.runs; ++i) {
            for (uint64_t k = 0; k < seg.count; ++k) {
              const uint64_t at = (seg.local_offset + i * seg.local_stride) / 4 + k;
              ASSERT_LT(at, local[h].size());
              ASSERT_EQ(local[h][at], -1) << "written twice on rank " << h;
              local[h][at] = static_cast<int64_t>(base + seg.first + i * seg.stride + k);
            }
          }
        }
      }
    }
    for (int r = 0; r < world; ++r) {
      for (size_t i = 0; i < expected[r].size(); ++i) {
        ASSERT_EQ(local[r][i], static_cast<int64_t>(expected[r][i])) << "rank " << r << " local element " << i;
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Seeds, LayoutProperty, ::testing::Range(0, 10));

}  // namespace
}  // namespace shardcast
