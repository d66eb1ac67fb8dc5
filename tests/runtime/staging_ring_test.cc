// The reader side of a stream over a real checkpoint file: every selected message, in schedule order,
// bit-exact (dtype conversion included), each segment in place when asked, and a truncated file is an
// error.
#include "runtime/stream/staging_ring.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <fstream>
#include <map>
#include <thread>

#include "allocators/lazy_zero.h"
#include "allocators/pinned.h"
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

  Manifest Make(int world, uint64_t chunk, uint64_t coalesce = 200) {
    plan_ = std::make_unique<Plan>(Plan::Build(spec_, world));
    StreamParams p;
    p.chunk_bytes = chunk;
    p.coalesce_bytes = std::min(chunk, coalesce);
    p.staging_slots = 2;
    return Resolve(*plan_, *ckpt_, {}, p);
  }

  // A file source over a copy of `m` and the fixture's files (the fixture's checkpoint outlives every ring).
  std::shared_ptr<FileSource> SourceOf(const Manifest& m) {
    return std::make_shared<FileSource>(std::make_shared<const Manifest>(m), std::make_shared<const FileTable>(files_),
                                        true);
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

// With one reader, and with three reading several messages at once (the consumer still gets them in order).
TEST_F(StagingRingTest, EverySelectedMessageInScheduleOrderBitExact) {
  for (uint32_t readers : {1u, 3u}) {
  for (int world : {1, 3, 4}) {
    for (uint64_t chunk : {uint64_t{64}, uint64_t{4096}}) {
      SCOPED_TRACE("readers " + std::to_string(readers));
      Manifest m = Make(world, chunk);
      RingOptions o;
      o.slots = readers == 1 ? 2 : 4;
      o.readers = readers;
      o.readahead_bytes = 1024;
      o.select = [](const Message& msg) { return msg.dest != 1; };  // not rank 1's rows
      StagingRing ring(m, SourceOf(m), o);
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
      EXPECT_EQ(ring.bytes_read(), [&] {
        uint64_t n = 0;
        Schedule all(m);
        for (Message x; all.Next(&x);) {
          if (x.dest != 1) for (const Segment& g : x.segments) n += g.source_bytes;
        }
        return n;
      }());
    }
  }
  }
}

// Every segment of an in-place message lands in its own place (a batch of small tensors, each in its
// shard); the other messages are staged, contiguous, as before.
TEST_F(StagingRingTest, ReadsEachSegmentInPlaceWhereTheConsumerGivesPlaces) {
  for (uint32_t readers : {1u, 3u}) {
  SCOPED_TRACE("readers " + std::to_string(readers));
  Manifest m = Make(2, 4096, 4096);  // small entries batched: messages of several segments
  std::map<std::pair<uint64_t, size_t>, std::string> places;  // by (message seq, segment)
  RingOptions o;
  o.slots = 3;
  o.readers = readers;
  o.select = [](const Message&) { return true; };
  std::mutex mu;
  o.in_place = [&](const Message& msg, std::vector<unsigned char*>* at) {
    if (msg.seq % 2) return false;
    std::lock_guard<std::mutex> l(mu);
    at->clear();
    for (size_t i = 0; i < msg.segments.size(); ++i) {
      std::string& s = places[{msg.seq, i}];
      s.assign(msg.segments[i].target_bytes, '\0');
      at->push_back(reinterpret_cast<unsigned char*>(s.data()));
    }
    return true;
  };
  StagingRing ring(m, SourceOf(m), o);
  int in_place = 0, batched_in_place = 0, staged = 0;
  while (StagingRing::Slot* slot = ring.Next()) {
    const auto& segs = slot->msg.segments;
    ASSERT_EQ(slot->at.size(), segs.size());
    EXPECT_EQ(slot->in_place, slot->msg.seq % 2 == 0);
    if (slot->in_place) {
      ++in_place;
      batched_in_place += segs.size() > 1;
      EXPECT_EQ(slot->data, nullptr);
    } else {
      ++staged;
    }
    uint64_t off = 0;
    for (size_t i = 0; i < segs.size(); ++i) {
      if (slot->in_place) {
        std::lock_guard<std::mutex> l(mu);
        EXPECT_EQ(slot->at[i], reinterpret_cast<unsigned char*>(places[{slot->msg.seq, i}].data()));
      } else {
        EXPECT_EQ(slot->at[i], slot->data + off);
      }
      EXPECT_EQ(std::string(reinterpret_cast<char*>(slot->at[i]), segs[i].target_bytes), Expected(m, segs[i]))
          << m.entries[segs[i].entry].key << " message " << slot->msg.seq << " segment " << i;
      off += segs[i].target_bytes;
    }
    ring.Free(slot);
  }
  EXPECT_GT(in_place, 0);
  EXPECT_GT(batched_in_place, 0);
  EXPECT_GT(staged, 0);
  }
}

// A reader commits an in-place destination's missing pages in one call (MADV_POPULATE_WRITE) before it
// reads there, rather than having them faulted one by one inside the read's copy: every page of fresh
// memory a segment lands in is resident when the source is asked for the segment. Bytes exact.
TEST(StagingRingInPlace, AReaderCommitsItsFreshDestinationBeforeItReadsThere) {
  const long page = sysconf(_SC_PAGESIZE);
  constexpr size_t kBytes = 8u << 20;
  void* probe = mmap(nullptr, page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  ASSERT_NE(probe, MAP_FAILED);
  const bool populates = PrefaultForWrite(probe, page);
  munmap(probe, page);
  if (!populates) GTEST_SKIP() << "no MADV_POPULATE_WRITE in this kernel (before 5.14)";

  testing::TempDir dir;
  const std::vector<WriteEntry> entries = {{"w", DType::kBF16, {4096, 1024}}};
  WriteCheckpoint(dir.path(), entries, [](const WriteEntry& e, uint64_t off, unsigned char* out, size_t n) {
    SynthElements(5, e.key, e.dtype, off / 2, n / 2, out);
  });
  ModelSpec spec;
  spec.model_type = "test";
  spec.entries.push_back(SpecEntry{});
  spec.entries[0].key = "w";
  spec.entries[0].shape = {4096, 1024};
  spec.entries[0].dtype = DType::kBF16;
  std::unique_ptr<Checkpoint> ckpt = Checkpoint::Open(dir.path());
  const Plan plan = Plan::Build(spec, 1);
  StreamParams params;
  params.chunk_bytes = 1u << 20;
  params.coalesce_bytes = 1u << 20;
  params.staging_slots = 2;
  const Manifest m = Resolve(plan, *ckpt, {}, params);

  // The checkpoint's source, which counts the pages of each destination not resident when it is read into.
  struct Checking : SegmentSource {
    std::shared_ptr<FileSource> file;
    long page;
    std::atomic<uint64_t> missing{0}, reads{0};
    void Read(const Segment& s, unsigned char* out) override {
      const uintptr_t begin = (reinterpret_cast<uintptr_t>(out) + page - 1) / page * page;
      const uintptr_t end = (reinterpret_cast<uintptr_t>(out) + s.target_bytes) / page * page;
      if (end > begin) {
        std::vector<unsigned char> resident((end - begin) / page);
        if (mincore(reinterpret_cast<void*>(begin), end - begin, resident.data()) == 0) {
          for (unsigned char r : resident) missing += (r & 1) == 0;
        }
      }
      ++reads;
      file->Read(s, out);
    }
  };
  auto source = std::make_shared<Checking>();
  source->file = std::make_shared<FileSource>(std::make_shared<const Manifest>(m),
                                              std::make_shared<const FileTable>(FileTable{&ckpt->file(0)}), true);
  source->page = page;

  auto* dest = static_cast<unsigned char*>(
      mmap(nullptr, kBytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));  // no page yet
  ASSERT_NE(dest, MAP_FAILED);
  RingOptions o;
  o.slots = 2;
  o.readers = 2;
  o.select = [](const Message&) { return true; };
  o.in_place = [&](const Message& msg, std::vector<unsigned char*>* at) {
    at->clear();
    for (const Segment& s : msg.segments) at->push_back(dest + s.local_offset);
    return true;
  };
  {
    StagingRing ring(m, source, o);
    while (StagingRing::Slot* slot = ring.Next()) {
      EXPECT_TRUE(slot->in_place);
      ring.Free(slot);
    }
  }
  EXPECT_GE(source->reads.load(), 8u);
  EXPECT_EQ(source->missing.load(), 0u) << "pages of a destination not committed before the read into it";
  std::string expected(kBytes, '\0');
  SynthElements(5, "w", DType::kBF16, 0, kBytes / 2, expected.data());
  EXPECT_EQ(std::memcmp(dest, expected.data(), kBytes), 0);
  munmap(dest, kBytes);
}

// Pinned staging (a CUDA target): the slots are page-locked where this machine can (a GPU machine), else
// they stay pageable and say so; a message larger than the pinned slot goes through pageable memory
// beside it. The bytes are the same either way.
TEST_F(StagingRingTest, PinnedSlotsWhereTheMachineCanAndTheSameBytesEitherWay) {
  const bool can_pin = [] {
    try {
      PinnedBuffer::Allocate(1);
      return true;
    } catch (const Error&) {
      return false;
    }
  }();
  Manifest m = Make(2, 4096);
  for (uint64_t pin : {uint64_t{4096}, uint64_t{256}}) {  // 256: most messages are larger
    RingOptions o;
    o.slots = 3;
    o.readers = 2;
    o.pin_bytes = pin;
    o.select = [](const Message&) { return true; };
    StagingRing ring(m, SourceOf(m), o);
    EXPECT_EQ(ring.pinned(), can_pin);
    uint64_t count = 0;
    while (StagingRing::Slot* slot = ring.Next()) {
      uint64_t off = 0;
      for (const Segment& s : slot->msg.segments) {
        ASSERT_EQ(std::string(reinterpret_cast<char*>(slot->data) + off, s.target_bytes), Expected(m, s));
        off += s.target_bytes;
      }
      ring.Free(slot);
      ++count;
    }
    EXPECT_GT(count, 3u);
  }
}

// The bytes of this process's mappings advised MADV_HUGEPAGE ("hg" in their VmFlags; adjacent ones merge
// into one mapping), and whether smaps showed VmFlags at all.
std::pair<uint64_t, bool> HugeAdvisedBytes() {
  uint64_t total = 0;
  bool flags = false;
  for (const testing::Mapping& m : testing::Smaps()) {
    flags |= !m.vm_flags.empty();
    if (m.Advised("hg")) total += m.end - m.begin;
  }
  return {total, flags};
}

// The slots a CUDA target page-locks are asked for 2 MiB pages (the registration faults in, a 2 MiB page at
// a time, what the readers have not), whether or not the pinning then succeeds: without a GPU the
// registration is refused and the slots stay pageable. Every slot is made whole before the readers start
// (the readers and the registration share no buffer), so every slot is advised, not only the first. Slots
// not to be pinned keep 4 KiB pages.
TEST_F(StagingRingTest, SlotsToBePageLockedAreAdvisedHugePages) {
#if defined(__SANITIZE_ADDRESS__)
  GTEST_SKIP() << "an ASan build's slots come from the heap";
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
  GTEST_SKIP() << "an ASan build's slots come from the heap";
#endif
#endif
  if (!std::ifstream("/sys/kernel/mm/transparent_hugepage/enabled")) GTEST_SKIP() << "no THP in this kernel";
  constexpr uint64_t kPin = 6ull << 20;
  const auto [before, flags] = HugeAdvisedBytes();
  if (!flags) GTEST_SKIP() << "no VmFlags in /proc/self/smaps (a sandboxed kernel)";
  Manifest m = Make(2, 4096);
  for (uint64_t pin : {kPin, uint64_t{0}}) {
    RingOptions o;
    o.slots = 3;
    o.pin_bytes = pin;
    o.select = [](const Message&) { return true; };
    StagingRing ring(m, SourceOf(m), o);
    const uint64_t advised = HugeAdvisedBytes().first - before;
    if (pin > 0) {
      EXPECT_GE(advised, o.slots * kPin);
    } else {
      EXPECT_EQ(advised, 0u);
    }
    while (StagingRing::Slot* slot = ring.Next()) ring.Free(slot);
  }
}

TEST_F(StagingRingTest, AFileTruncatedWhileOpenIsACheckpointErrorFromNext) {
  Manifest m = Make(1, 64);
  ASSERT_EQ(truncate(ckpt_->file(0).path().c_str(), 200), 0);
  for (uint32_t readers : {1u, 4u}) {  // with several, the others stop and the ring still ends
    RingOptions o;
    o.slots = 4;
    o.readers = readers;
    o.select = [](const Message&) { return true; };
    StagingRing ring(m, SourceOf(m), o);
    EXPECT_SC_ERROR(
        {
          while (StagingRing::Slot* slot = ring.Next()) ring.Free(slot);
        },
        ErrorKind::kCheckpoint, "truncated", "model.safetensors");
  }
}

// A storage read that never returns until the test writes: a read() of a FIFO nobody else writes to
// (opened read-write, so it is never at end of file). What the source did is recorded in a trace the
// test keeps; the source itself is the ring's (and its reader's) alone.
struct FifoTrace {
  std::atomic<bool> entered{false}, returned{false}, destroyed{false};
};

class FifoSource : public SegmentSource {
 public:
  FifoSource(int fd, std::shared_ptr<FifoTrace> trace) : fd_(fd), trace_(std::move(trace)) {}
  ~FifoSource() override { trace_->destroyed = true; }
  void Read(const Segment& s, unsigned char* out) override {
    char c;
    trace_->entered = true;
    EXPECT_EQ(read(fd_, &c, 1), 1);
    std::memset(out, 0, s.target_bytes);
    trace_->returned = true;
  }

 private:
  int fd_;
  std::shared_ptr<FifoTrace> trace_;
};

// The reader is left behind in a hung read and the ring ends without it; the source, which only the ring
// and that reader hold, stays alive until the read returns and is destroyed by the reader itself. (Before
// the source was shared, it was the caller's: gone with the caller's frame while the read still ran.)
TEST_F(StagingRingTest, AReaderStuckInStorageIsAnIoErrorByTheDeadlineAndTheRingEndsWithoutIt) {
  for (uint32_t readers : {1u, 2u}) {  // two: both stuck, both left behind, the source freed by the last
  SCOPED_TRACE("readers " + std::to_string(readers));
  Manifest m = Make(1, 64);
  const std::string fifo = dir_.path() + "/stuck" + std::to_string(readers) + ".fifo";
  ASSERT_EQ(mkfifo(fifo.c_str(), 0600), 0);
  const int fd = open(fifo.c_str(), O_RDWR);
  ASSERT_GE(fd, 0);
  auto trace = std::make_shared<FifoTrace>();
  RingOptions o;
  o.slots = 2;
  o.readers = readers;
  o.readahead_bytes = 0;
  o.select = [](const Message&) { return true; };
  o.abandon_after = std::chrono::milliseconds(100);
  auto ring = std::make_unique<StagingRing>(m, std::make_shared<FifoSource>(fd, trace), o);
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_SC_ERROR(ring->Next(t0 + std::chrono::milliseconds(300)), ErrorKind::kIo, "no message read by the deadline",
                  "message 0");
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(5));
  EXPECT_TRUE(trace->entered);
  const auto t1 = std::chrono::steady_clock::now();
  ring.reset();  // the reader is still in read(): left behind, not joined
  EXPECT_LT(std::chrono::steady_clock::now() - t1, std::chrono::seconds(5));
  EXPECT_FALSE(trace->returned);
  EXPECT_FALSE(trace->destroyed);  // nobody but the reader holds it now, and it is inside it
  // Let the readers out: they return into the live source, then the last drops the last reference.
  for (uint32_t r = 0; r < readers; ++r) ASSERT_EQ(write(fd, "x", 1), 1);
  for (int i = 0; i < 500 && !trace->destroyed; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  EXPECT_TRUE(trace->returned);
  EXPECT_TRUE(trace->destroyed);
  close(fd);
  }
}

}  // namespace
}  // namespace shardcast
