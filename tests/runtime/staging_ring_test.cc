// The reader side of a stream over a real checkpoint file: every selected message, in schedule order,
// bit-exact (dtype conversion included), in place when asked, and a truncated file is an error.
#include "runtime/staging_ring.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cstring>
#include <map>

#include "loaders/synth.h"
#include "loaders/writer.h"
#include "tests/loaders/test_util.h"

namespace shardcast {
namespace {

class StagingRingTest : public ::testing::Test {
 protected:
  void SetUp() override {
    // bf16 as bf16, f32 converted to bf16 in the ring, an f32 kept as f32; uneven rows.
    std::vector<WriteEntry> entries = {{"a", DType::kBF16, {37, 24}}, {"b", DType::kF32, {11, 30}},
                                       {"c", DType::kF32, {5}}, {"d", DType::kBF16, {301, 8}}};
    WriteCheckpoint(dir_.path(), entries, [](const WriteEntry& e, uint64_t off, unsigned char* out, size_t n) {
      const uint64_t es = DTypeSize(e.dtype);
      SynthElements(3, e.key, e.dtype, off / es, n / es, out);
    });
    spec_.model_type = "test";
    for (const auto& e : entries) {
      SpecEntry s;
      s.key = e.key;
      s.shape = e.shape;
      s.dtype = e.key == "b" ? DType::kBF16 : e.dtype;
      spec_.entries.push_back(s);
    }
    ckpt_ = Checkpoint::Open(dir_.path());
    files_ = {&ckpt_->file(0)};
  }

  Manifest Make(int world, uint64_t chunk) {
    plan_ = std::make_unique<Plan>(Plan::Build(spec_, world));
    StreamParams p;
    p.chunk_bytes = chunk;
    p.coalesce_bytes = std::min<uint64_t>(chunk, 200);
    p.staging_slots = 2;
    return Resolve(*plan_, *ckpt_, {}, p);
  }

  // The target bytes a segment must hold: synthetic source values, converted.
  std::string Expected(const Manifest& m, const Segment& s) {
    const ManifestEntry& e = m.entries[s.entry];
    const ManifestPart& p = e.parts[s.part];
    std::string src(s.source_bytes, '\0'), dst(s.target_bytes, '\0');
    SynthElements(3, p.checkpoint_key, p.source_dtype, s.first, s.count, src.data());
    ConvertElements(p.source_dtype, e.target_dtype, src.data(), dst.data(), s.count);
    return dst;
  }

  testing::TempDir dir_;
  ModelSpec spec_;
  std::unique_ptr<Plan> plan_;
  std::unique_ptr<Checkpoint> ckpt_;
  FileTable files_;
};

TEST_F(StagingRingTest, EverySelectedMessageInScheduleOrderBitExact) {
  for (int world : {1, 3, 4}) {
    for (uint64_t chunk : {uint64_t{64}, uint64_t{4096}}) {
      Manifest m = Make(world, chunk);
      RingOptions o;
      o.slots = 2;
      o.readahead_bytes = 1024;
      o.select = [](const Message& msg) { return msg.dest != 1; };  // not rank 1's rows
      FileSource source(m, files_, true);
      StagingRing ring(m, source, o);
      Schedule schedule(m);
      Message msg;
      uint64_t count = 0;
      while (schedule.Next(&msg)) {
        if (msg.dest == 1) continue;
        StagingRing::Slot* slot = ring.Next();
        ASSERT_NE(slot, nullptr);
        ASSERT_EQ(slot->msg.seq, msg.seq);
        EXPECT_FALSE(slot->in_place);
        uint64_t off = 0;
        for (const Segment& s : slot->msg.segments) {
          ASSERT_EQ(std::string(reinterpret_cast<char*>(slot->data) + off, s.target_bytes), Expected(m, s))
              << m.entries[s.entry].key << " world " << world << " chunk " << chunk;
          off += s.target_bytes;
        }
        ring.Free(slot);
        ++count;
      }
      EXPECT_EQ(ring.Next(), nullptr);
      EXPECT_GT(count, 0u);
    }
  }
}

TEST_F(StagingRingTest, ReadsInPlaceWhereTheConsumerGivesAPlace) {
  Manifest m = Make(2, 128);
  std::map<uint64_t, std::string> places;  // by message seq
  RingOptions o;
  o.slots = 3;
  o.select = [](const Message&) { return true; };
  std::mutex mu;
  o.in_place = [&](const Message& msg) -> unsigned char* {
    if (!msg.direct() || msg.seq % 2) return nullptr;
    std::lock_guard<std::mutex> l(mu);
    std::string& s = places[msg.seq];
    s.assign(msg.target_bytes, '\0');
    return reinterpret_cast<unsigned char*>(s.data());
  };
  FileSource source(m, files_, true);
      StagingRing ring(m, source, o);
  int in_place = 0;
  while (StagingRing::Slot* slot = ring.Next()) {
    if (slot->in_place) {
      ++in_place;
      std::lock_guard<std::mutex> l(mu);
      EXPECT_EQ(slot->data, reinterpret_cast<unsigned char*>(places[slot->msg.seq].data()));
    }
    EXPECT_EQ(std::string(reinterpret_cast<char*>(slot->data), slot->msg.segments[0].target_bytes),
              Expected(m, slot->msg.segments[0]));
    ring.Free(slot);
  }
  EXPECT_GT(in_place, 0);
}

TEST_F(StagingRingTest, AFileTruncatedWhileOpenIsACheckpointErrorFromNext) {
  Manifest m = Make(1, 64);
  ASSERT_EQ(truncate(ckpt_->file(0).path().c_str(), 200), 0);
  RingOptions o;
  o.slots = 2;
  o.select = [](const Message&) { return true; };
  FileSource source(m, files_, true);
      StagingRing ring(m, source, o);
  EXPECT_SC_ERROR(
      {
        while (StagingRing::Slot* slot = ring.Next()) ring.Free(slot);
      },
      ErrorKind::kCheckpoint, "truncated", "model.safetensors");
}

}  // namespace
}  // namespace shardcast
