// The schedule every rank derives alone: coverage, coalescing, cuts on part rows, parts that cross
// segments, zero-row ranks, broadcasts, for every world size 1-8 and shapes that do not divide.
#include "runtime/stream/schedule.h"

#include <gtest/gtest.h>

#include <map>

#include "runtime/stream/route.h"

namespace shardcast {
namespace {

// An entry of `rows` x `cols` elements supplied by `parts` consecutive checkpoint tensors, laid out
// back to back in file 0 from `*offset`; its keys and shapes kept by `m`, the manifest it goes into.
ManifestEntry Entry(Manifest* m, const std::string& key, uint64_t rows, uint64_t cols, DType src, DType dst, int parts,
                    uint64_t* offset, bool replicated = false) {
  ManifestEntry e;
  e.key = m->Keep(key);
  e.target_dtype = dst;
  e.shape = m->KeepShape(cols ? std::vector<uint64_t>{rows, cols} : std::vector<uint64_t>{rows});
  e.layout = replicated ? 0 : 1;  // Model's layouts: [Replicate, FSDP2's Shard(0)]
  const uint64_t per = rows / parts;  // each part is `per` rows (the last takes the rest)
  for (int p = 0; p < parts; ++p) {
    ManifestPart part;
    part.checkpoint_key = m->Keep(key + "." + std::to_string(p));
    part.source_dtype = src;
    const uint64_t r = p == parts - 1 ? rows - per * (parts - 1) : per;
    part.numel = r * std::max<uint64_t>(cols, 1);
    part.shape = m->KeepShape(cols ? std::vector<uint64_t>{r, cols} : std::vector<uint64_t>{r});
    part.offset = *offset;
    *offset += part.numel * DTypeSize(src);
    e.parts.push_back(part);
  }
  return e;
}

Manifest Model(int world, uint64_t chunk, uint64_t coalesce) {
  Manifest m;
  m.world_size = world;
  m.params.chunk_bytes = chunk;
  m.params.coalesce_bytes = coalesce;
  m.layouts = {ReplicatedLayout(), DimZeroLayout(world)};
  uint64_t off = 1000;
  m.entries.push_back(Entry(&m, "embed", 37, 24, DType::kBF16, DType::kBF16, 1, &off));
  m.entries.push_back(Entry(&m, "norm", 24, 0, DType::kF32, DType::kBF16, 1, &off, true));
  m.entries.push_back(Entry(&m, "tiny", 5, 3, DType::kBF16, DType::kBF16, 1, &off));            // zero-row ranks
  m.entries.push_back(Entry(&m, "experts", 12, 40, DType::kBF16, DType::kBF16, 4, &off));       // composed
  m.entries.push_back(Entry(&m, "wide", 3, 4000, DType::kF16, DType::kF32, 1, &off));           // row > chunk
  m.entries.push_back(Entry(&m, "vec", 1001, 0, DType::kBF16, DType::kBF16, 1, &off));          // 1-d
  m.entries.push_back(Entry(&m, "bias", 7, 0, DType::kF32, DType::kF32, 1, &off, true));
  return m;
}

struct Walk {
  std::vector<Message> messages;
  // (dest, entry) -> local target byte -> count of times written
  std::map<std::pair<int, uint32_t>, std::vector<int>> written;
};

Walk WalkAll(const Manifest& m) {
  Walk w;
  Schedule s(m);
  Message msg;
  while (s.Next(&msg)) w.messages.push_back(msg);
  return w;
}

class ScheduleWorld : public ::testing::TestWithParam<int> {};

TEST_P(ScheduleWorld, EveryRankGetsExactlyItsRowsOnceAtTheRightPlace) {
  const int world = GetParam();
  for (uint64_t chunk : {uint64_t{64}, uint64_t{1000}, uint64_t{1} << 20}) {
    const Manifest m = Model(world, chunk, std::min<uint64_t>(chunk, 300));
    const Walk w = WalkAll(m);
    std::map<std::pair<int, uint32_t>, std::vector<int>> seen;
    uint64_t seq = 0;
    for (const Message& msg : w.messages) {
      EXPECT_EQ(msg.seq, seq++);
      uint64_t sum = 0;
      for (const Segment& s : msg.segments) {
        const ManifestEntry& e = m.entries[s.entry];
        const ManifestPart& p = e.parts[s.part];
        const uint64_t ss = DTypeSize(p.source_dtype), ts = DTypeSize(e.target_dtype);
        // A segment never crosses a part, and its source range is the part's elements [first, first + count).
        ASSERT_LE(s.first + s.count, p.numel);
        EXPECT_EQ(s.source_offset, p.offset + s.first * ss);
        EXPECT_EQ(s.source_bytes, s.count * ss);
        EXPECT_EQ(s.target_bytes, s.count * ts);
        // Where it lands: the entry element it is, minus the first element of the destination's rows.
        uint64_t part_start = 0;
        for (uint32_t q = 0; q < s.part; ++q) part_start += e.parts[q].numel;
        const uint64_t rows = e.shape[0], row_elems = e.shape.size() > 1 ? e.shape[1] : 1;
        const int dest = msg.dest == kBroadcast ? 0 : msg.dest;
        const uint64_t local_first = msg.dest == kBroadcast ? 0 : ShardRows(rows, world, dest).begin * row_elems;
        EXPECT_EQ(s.local_offset, (part_start + s.first - local_first) * ts) << e.key;
        // A world of one holds every entry whole: its shards arrive as broadcasts (to itself).
        auto& cells = seen[{world == 1 ? 0 : msg.dest, s.entry}];
        if (cells.empty()) cells.resize(rows * row_elems * ts);
        for (uint64_t b = 0; b < s.target_bytes; ++b) ++cells[s.local_offset + b];
        sum += s.target_bytes;
      }
      EXPECT_EQ(sum, msg.target_bytes);
      EXPECT_FALSE(msg.segments.empty());
      if (msg.segments.size() > 1) {
        EXPECT_LE(msg.target_bytes, m.params.coalesce_bytes) << "a pack over the limit";
      }
    }
    for (uint32_t i = 0; i < m.entries.size(); ++i) {
      const ManifestEntry& e = m.entries[i];
      const uint64_t row_elems = e.shape.size() > 1 ? e.shape[1] : 1, ts = DTypeSize(e.target_dtype);
      if (e.layout == 0) {
        const auto& cells = seen[{world == 1 ? 0 : kBroadcast, i}];
        ASSERT_EQ(cells.size(), e.shape[0] * row_elems * ts) << e.key;
        for (int c : cells) ASSERT_EQ(c, 1) << e.key;
        continue;
      }
      for (int r = 0; r < world; ++r) {
        const RowRange mine = ShardRows(e.shape[0], world, r);
        auto it = seen.find({r, i});
        if (mine.empty()) {
          EXPECT_TRUE(it == seen.end()) << e.key << ": a zero-row rank got a message";
          continue;
        }
        ASSERT_TRUE(it != seen.end()) << e.key << " rank " << r;
        const uint64_t bytes = mine.rows() * row_elems * ts;
        for (uint64_t b = 0; b < bytes; ++b) ASSERT_EQ(it->second[b], 1) << e.key << " rank " << r << " byte " << b;
        for (uint64_t b = bytes; b < it->second.size(); ++b) ASSERT_EQ(it->second[b], 0) << e.key;
      }
    }
  }
}

TEST_P(ScheduleWorld, CutsFallOnPartRowsAndARowLargerThanAChunkIsOneMessage) {
  const int world = GetParam();
  const Manifest m = Model(world, 64, 64);
  for (const Message& msg : WalkAll(m).messages) {
    if (!msg.direct()) continue;
    const Segment& s = msg.segments[0];
    const ManifestEntry& e = m.entries[s.entry];
    const ManifestPart& p = e.parts[s.part];
    if (p.shape.size() < 2) continue;  // 1-d: cut on elements
    const uint64_t row = p.row_elems();
    EXPECT_EQ(s.first % row, 0u) << e.key;
    EXPECT_EQ(s.count % row, 0u) << e.key;
    const uint64_t widest = std::max(DTypeSize(p.source_dtype), DTypeSize(e.target_dtype));
    EXPECT_LE(s.count, std::max<uint64_t>(row, 64 / widest / row * row)) << e.key;
  }
}

INSTANTIATE_TEST_SUITE_P(W1to8, ScheduleWorld, ::testing::Range(1, 9));

TEST(Schedule, SmallSegmentsToOneRankArePackedAndLargeOnesGoInPlace) {
  Manifest m = Model(2, 1 << 20, 2000);
  int packs = 0, direct = 0;
  for (const Message& msg : WalkAll(m).messages) {
    if (msg.dest == kBroadcast) continue;
    (msg.segments.size() > 1 ? packs : direct)++;
  }
  EXPECT_GT(packs, 0);
  EXPECT_GT(direct, 0);
}

// Model's entries over several layouts: FSDP, HSDP (2 replicas), a (Shard(0), Replicate()) mesh whose
// rows are replica groups, Shard(1), and replicated ones.
Manifest Layered(int world, uint64_t chunk, uint64_t coalesce) {
  Manifest m = Model(world, chunk, coalesce);
  Placement s0{Placement::kShard, 0}, s1{Placement::kShard, 1}, rep{};
  std::vector<int> all(world);
  for (int r = 0; r < world; ++r) all[r] = r;
  if (world % 2 == 0) {
    m.layouts.push_back(DimZeroLayout(world, 2));
    m.layouts.push_back(Layout{{2, static_cast<uint32_t>(world / 2)}, all, {s0, rep}, {}});
  } else {
    m.layouts.push_back(DimZeroLayout(world));
    m.layouts.push_back(Layout{{static_cast<uint32_t>(world)}, all, {s1}, {}});
  }
  m.layouts.push_back(Layout{{static_cast<uint32_t>(world)}, all, {s1}, {}});
  uint64_t off = 1 << 20;
  for (int layer = 0; layer < 3; ++layer) {
    for (uint32_t l = 1; l < m.layouts.size(); ++l) {
      const std::string key = "l" + std::to_string(layer) + "." + std::to_string(l);
      ManifestEntry a = Entry(&m, key + ".w", 9 + layer, 40, DType::kBF16, DType::kBF16, 1 + layer % 2, &off);
      a.layout = l;
      m.entries.push_back(a);
      ManifestEntry b = Entry(&m, key + ".small", 3, 5, DType::kF32, DType::kBF16, 1, &off);
      b.layout = l;
      m.entries.push_back(b);
    }
  }
  return m;
}

void ExpectSameMessage(const Message& got, const Message& want) {
  ASSERT_EQ(got.seq, want.seq);
  EXPECT_EQ(got.dest, want.dest);
  EXPECT_EQ(got.target_bytes, want.target_bytes);
  if (want.holders) {
    ASSERT_TRUE(got.holders);
    EXPECT_EQ(*got.holders, *want.holders);
  }
  ASSERT_EQ(got.segments.size(), want.segments.size());
  for (size_t i = 0; i < got.segments.size(); ++i) {
    const Segment &a = got.segments[i], &b = want.segments[i];
    EXPECT_EQ(std::tie(a.entry, a.part, a.first, a.count, a.runs, a.stride, a.source_offset, a.source_bytes,
                       a.local_offset, a.local_stride, a.target_bytes),
              std::tie(b.entry, b.part, b.first, b.count, b.runs, b.stride, b.source_offset, b.source_bytes,
                       b.local_offset, b.local_stride, b.target_bytes))
        << "seq " << got.seq << " segment " << i;
  }
}

// A rank's part of the schedule is the whole schedule's messages that its route has it take part in,
// with the same seq, bytes and order, whatever the route, world, layouts and verify.
TEST_P(ScheduleWorld, ARanksPartIsExactlyTheMessagesItTakesPartIn) {
  const int world = GetParam();
  NodeMap nodes;
  for (int r = 0; r < world; ++r) nodes.node_of_rank.push_back(r / 3);
  std::vector<std::unique_ptr<Route>> routes;
  for (Source s : {Source::kRank0, Source::kEachRank, Source::kNodeLeader, Source::kStriped}) {
    routes.push_back(Route::Make(s, world, nodes));
  }
  routes.push_back(Route::MakeSave(Route::SaveMode::kCollector, world));
  routes.push_back(Route::MakeSave(Route::SaveMode::kEachWriter, world));
  for (uint64_t chunk : {uint64_t{64}, uint64_t{1000}, uint64_t{1} << 20}) {
    for (uint64_t coalesce : {uint64_t{0}, uint64_t{50}, chunk}) {
      const Manifest m = Layered(world, chunk, coalesce);
      const std::vector<Message> all = WalkAll(m).messages;
      for (const auto& route : routes) {
        for (bool verify : {false, true}) {
          for (int rank = 0; rank < world; ++rank) {
            SCOPED_TRACE(std::string(route->name()) + " rank " + std::to_string(rank) + " verify " +
                         std::to_string(verify) + " chunk " + std::to_string(chunk) + " coalesce " +
                         std::to_string(coalesce));
            Schedule mine(m, route->InterestOf(rank, verify));
            Message msg;
            size_t at = 0;
            uint64_t taken = 0;
            while (mine.Next(&msg)) {
              while (at < all.size() && all[at].seq < msg.seq) {
                ASSERT_FALSE(route->For(all[at], rank, verify).any()) << "left out: seq " << all[at].seq;
                ++at;
              }
              ASSERT_LT(at, all.size());
              ExpectSameMessage(msg, all[at++]);
              ++taken;
            }
            for (; at < all.size(); ++at) ASSERT_FALSE(route->For(all[at], rank, verify).any());
            if (world > 2 && route->name() == std::string("striped")) {
              EXPECT_LT(taken, all.size());
            }
          }
        }
      }
    }
  }
}

}  // namespace
}  // namespace shardcast
