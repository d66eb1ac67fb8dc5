#include "loaders/safetensors_file.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <cstring>
#include <fstream>
#include <vector>

#include "loaders/posix_file.h"
#include "loaders/writer.h"
#include "tests/loaders/test_util.h"

namespace shardcast {
namespace {

// [5, 3] int32 with value r*10+c, and a 0-dim scalar.
std::string MakeFile(const testing::TempDir& dir) {
  std::string path = dir / "m.safetensors";
  SafetensorsWriter w(path, {{"m", DType::kI32, {5, 3}}, {"s", DType::kF32, {}}});
  for (int32_t r = 0; r < 5; ++r) {
    for (int32_t c = 0; c < 3; ++c) {
      int32_t v = r * 10 + c;
      w.Append(&v, 4);
    }
  }
  float s = 2.5f;
  w.Append(&s, 4);
  w.Commit();
  return path;
}

// One u8 tensor "w" of n bytes, every byte `fill`, written in 1 MiB appends.
std::string MakeBigFile(const testing::TempDir& dir, const std::string& name, uint64_t n, unsigned char fill) {
  std::string path = dir / name;
  SafetensorsWriter w(path, {{"w", DType::kU8, {n}}});
  std::vector<unsigned char> chunk(1 << 20, fill);
  for (uint64_t i = 0; i < n; i += chunk.size()) w.Append(chunk.data(), std::min<uint64_t>(chunk.size(), n - i));
  w.Commit();
  return path;
}

TEST(SafetensorsFile, RowRangesAreContiguousAndAgreeAcrossModes) {
  testing::TempDir dir;
  std::string path = MakeFile(dir);
  auto mm = SafetensorsFile::Open(path);
  auto pr = SafetensorsFile::Open(path, OpenOptions{ReadMode::kPread});
  const TensorInfo& m = mm->Get("m");
  EXPECT_EQ(m.row_bytes(), 12u);
  ByteSpan rows = mm->RowRange(m, 1, 4);
  ASSERT_EQ(rows.size, 36u);
  int32_t v[9];
  std::memcpy(v, rows.data, 36);
  EXPECT_EQ(v[0], 10);
  EXPECT_EQ(v[8], 32);
  int32_t p[9];
  pr->ReadRows(pr->Get("m"), 1, 4, p);
  EXPECT_EQ(std::memcmp(v, p, 36), 0);
  EXPECT_EQ(mm->RowRange(m, 5, 5).size, 0u);  // an empty range at the end is valid
  EXPECT_EQ(mm->RowOffset(m, 2), mm->header().data_offset() + 24);
  float s = 0;
  mm->ReadRows(mm->Get("s"), 0, 1, &s);
  EXPECT_EQ(s, 2.5f);
  EXPECT_SC_ERROR(mm->RowRange(m, 2, 6), ErrorKind::kInvalidArgument, "tensor 'm'", "rows [2, 6)", "5 rows");
  EXPECT_SC_ERROR(pr->View(pr->Get("m")), ErrorKind::kInvalidArgument, "ReadMode::kMmap");
  EXPECT_SC_ERROR(mm->Get("nope"), ErrorKind::kCheckpoint, "no tensor 'nope'", path.c_str());
}

// Regression: a file truncated after Open must be an error naming the bytes, not SIGBUS.
TEST(SafetensorsFile, TruncatedAfterOpenIsAnErrorNotSigbus) {
  testing::TempDir dir;
  std::string path = dir / "big.safetensors";
  {
    SafetensorsWriter w(path, {{"w", DType::kU8, {4, 1 << 20}}});
    std::vector<unsigned char> row(1 << 20, 7);
    for (int i = 0; i < 4; ++i) w.Append(row.data(), row.size());
    w.Commit();
  }
  for (ReadMode mode : {ReadMode::kMmap, ReadMode::kPread}) {
    auto f = SafetensorsFile::Open(path, OpenOptions{mode});
    ASSERT_EQ(truncate(path.c_str(), 4096), 0);
    std::vector<unsigned char> out(1 << 20);
    EXPECT_SC_ERROR(f->ReadRows(f->Get("w"), 2, 3, out.data()), ErrorKind::kCheckpoint, "tensor 'w' rows [2, 3)",
                    "truncated", path.c_str());
    ASSERT_EQ(truncate(path.c_str(), f->file_size()), 0);  // restore for the next mode
  }
}

long RssFileKb() {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("RssFile:", 0) == 0) return std::stol(line.substr(8));
  }
  return -1;
}

TEST(SafetensorsFile, ReleasePagesDropsResidentFilePages) {
  testing::TempDir dir;
  const uint64_t n = 64ull << 20;
  std::string path = MakeBigFile(dir, "r.safetensors", n, 1);
  auto f = SafetensorsFile::Open(path);
  ByteSpan v = f->View(f->Get("w"));
  uint64_t sum = 0;
  for (uint64_t i = 0; i < v.size; i += 4096) sum += v.data[i];  // fault every page in
  EXPECT_EQ(sum, n / 4096);
  long before = RssFileKb();
  f->ReleasePages(f->RowOffset(f->Get("w"), 0), n);
  long after = RssFileKb();
  if (before < 0) GTEST_SKIP() << "no /proc/self/status";
  EXPECT_GT(before - after, 60 * 1024) << "before " << before << " kB, after " << after << " kB";
}

}  // namespace
}  // namespace shardcast

namespace shardcast {
namespace {

// Regression: releasing only the consumed pages left the kernel's fault-around neighbours mapped, so
// RssFile grew with the checkpoint when segments were read out of file order (as the scatter does).
TEST(SafetensorsFile, ReleaseCoversFaultAroundWhenReadingOutOfOrder) {
  testing::TempDir dir;
  std::string path = dir / "r.safetensors";
  const uint64_t n = 64ull << 20, seg = 100 << 10;  // segments not aligned to 64 KiB windows
  {
    SafetensorsWriter w(path, {{"w", DType::kU8, {n}}});
    std::vector<unsigned char> chunk(1 << 20, 3);
    for (uint64_t i = 0; i < n; i += chunk.size()) w.Append(chunk.data(), chunk.size());
    w.Commit();
  }
  auto f = SafetensorsFile::Open(path);
  const TensorInfo& t = f->Get("w");
  std::vector<unsigned char> out(seg);
  long before = RssFileKb();
  for (int pass = 0; pass < 2; ++pass) {  // even segments, then odd: every read lands beside released ones
    for (uint64_t s = pass; s * seg + seg <= n; s += 2) {
      f->ReadRows(t, s * seg, s * seg + seg, out.data());
      f->ReleasePages(f->RowOffset(t, s * seg), seg);
    }
  }
  long after = RssFileKb();
  if (before < 0) GTEST_SKIP() << "no /proc/self/status";
  EXPECT_LT(after - before, 4 * 1024) << "RssFile grew by " << (after - before) << " kB over a 64 MiB read";
}

}  // namespace
}  // namespace shardcast

namespace shardcast {
namespace {

// Regression: ReadBytes trusted its caller's range, so a wrong offset copied whatever lay past the end
// of the mapping (or, with pread, was misreported as a truncated file). Run in a child: on the old
// code an out-of-range copy may crash rather than return.
TEST(SafetensorsFile, ReadBytesOutsideTheFileIsAnErrorNamingTheRangeAndSize) {
  testing::TempDir dir;
  const std::string path = MakeFile(dir);
  for (ReadMode mode : {ReadMode::kMmap, ReadMode::kPread}) {
    SCOPED_TRACE(mode == ReadMode::kMmap ? "mmap" : "pread");
    auto f = SafetensorsFile::Open(path, OpenOptions{mode});
    const uint64_t size = f->file_size();
    struct Range {
      uint64_t offset, n;
      const char* text;
    };
    const std::string end = std::to_string(size);
    const std::string past = "bytes [" + std::to_string(size - 4) + ", " + std::to_string(size + 4) + ")";
    const std::string at_end = "bytes [" + end + ", " + std::to_string(size + 1) + ")";
    for (const auto& [offset, n, text] :
         {Range{size - 4, 8, past.c_str()}, Range{size, 1, at_end.c_str()},
          Range{1, ~0ull, "bytes [1, 1 + 18446744073709551615)"},  // offset + n wraps to 0
          Range{~0ull, 2, "bytes [18446744073709551615, 18446744073709551615 + 2)"}}) {
      auto o = testing::RunInChild(
          [&, offset = offset, n = n] {
            std::vector<unsigned char> dst(64);
            f->ReadBytes(offset, n, dst.data(), "the test's bytes");
            return std::string("read without error");
          },
          std::chrono::seconds(30));
      ASSERT_EQ(o.state, testing::ChildOutcome::kThrewError) << o.Describe();
      EXPECT_EQ(o.kind, ErrorKind::kCheckpoint) << o.Describe();
      for (const std::string& s : {path, std::string("the test's bytes"), std::string(text),
                                   "outside the file of " + end + " bytes"}) {
        EXPECT_NE(o.message.find(s), std::string::npos) << "lacks \"" << s << "\": " << o.message;
      }
    }
    // The last byte and an empty range at the end are still fine.
    unsigned char last = 0;
    f->ReadBytes(size - 1, 1, &last, "the last byte");
    f->ReadBytes(size, 0, &last, "nothing");
  }
}

TEST(SafetensorsFile, ReleasePagesOutsideTheFileIsAnError) {
  testing::TempDir dir;
  const std::string path = MakeFile(dir);
  auto f = SafetensorsFile::Open(path);
  const uint64_t size = f->file_size();
  EXPECT_SC_ERROR(f->ReleasePages(size - 1, 2), ErrorKind::kCheckpoint, path.c_str(), "release",
                  "outside the file of");
  EXPECT_SC_ERROR(f->ReleasePages(4096, ~0ull - 100), ErrorKind::kCheckpoint, "outside the file of");
  f->ReleasePages(0, size);  // the whole file is fine
  f->ReleasePages(size, 0);
}

}  // namespace
}  // namespace shardcast

namespace shardcast {
namespace {

// Ranks agree on files by name, size and header digest before any read: the digest must tell two
// headers apart by a single byte, and be the same for the same file however it is opened.
TEST(SafetensorsFile, HeaderDigestTellsOneHeaderByteApartAndIsStableAcrossOpens) {
  testing::TempDir dir;
  const std::string data(16, '\x11');
  const std::string a = testing::Image(R"({"__metadata__":{"v":"a"},"w":{"dtype":"U8","shape":[16],"data_offsets":[0,16]}})", data);
  std::string b = a;
  b[b.find("\"a\"") + 1] = 'b';  // one header byte, same length, same data
  testing::WriteFile(dir / "a.safetensors", a);
  testing::WriteFile(dir / "b.safetensors", b);
  auto fa = SafetensorsFile::Open(dir / "a.safetensors");
  auto fb = SafetensorsFile::Open(dir / "b.safetensors");
  auto fa_again = SafetensorsFile::Open(dir / "a.safetensors", OpenOptions{ReadMode::kPread});
  EXPECT_NE(fa->header_digest(), fb->header_digest());
  EXPECT_EQ(fa->header_digest(), fa_again->header_digest());
  // XXH3-64 of the 8-byte length prefix and the header JSON: the data area is not part of it.
  const size_t header_end = 8 + fa->header().header_bytes;
  EXPECT_EQ(fa->header_digest(), XXH3_64bits(a.data(), header_end));
  std::string c = a;
  c[header_end] = '\x22';
  testing::WriteFile(dir / "c.safetensors", c);
  EXPECT_EQ(SafetensorsFile::Open(dir / "c.safetensors")->header_digest(), fa->header_digest());
  // file_size is what fstat saw.
  struct stat st;
  ASSERT_EQ(stat((dir / "a.safetensors").c_str(), &st), 0);
  EXPECT_EQ(fa->file_size(), static_cast<uint64_t>(st.st_size));
  EXPECT_EQ(fa_again->file_size(), a.size());
}

}  // namespace
}  // namespace shardcast

namespace shardcast {
namespace {

// Fraction of [0, size) of the file in the page cache (mincore over a fresh read-only mapping).
double ResidentFraction(const std::string& path, uint64_t size) {
  UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  void* p = mmap(nullptr, size, PROT_READ, MAP_SHARED, fd.get(), 0);
  if (p == MAP_FAILED) return -1;
  const uint64_t page = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
  std::vector<unsigned char> vec((size + page - 1) / page);
  const int rc = mincore(p, size, vec.data());
  munmap(p, size);
  if (rc != 0) return -1;
  uint64_t in = 0;
  for (unsigned char v : vec) in += v & 1;
  return static_cast<double>(in) / static_cast<double>(vec.size());
}

// Regression: the kernel reads at most the device's read-ahead limit per POSIX_FADV_WILLNEED call
// (8 MiB on the development VM, 128 KiB-1.25 MiB on common NVMe defaults), so one call for a 64 MiB
// segment prefetched only its first part. Prefetch now asks in steps: every page comes in.
TEST(SafetensorsFile, PrefetchOfALargeRangeBringsInEveryPage) {
  testing::TempDir dir;
  const uint64_t n = 64ull << 20;
  std::string path = MakeBigFile(dir, "p.safetensors", n, 7);
  auto f = SafetensorsFile::Open(path, OpenOptions{ReadMode::kPread});
  {
    UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
    fdatasync(fd.get());
    posix_fadvise(fd.get(), 0, 0, POSIX_FADV_DONTNEED);
  }
  const double cold = ResidentFraction(path, f->file_size());
  if (cold < 0 || cold > 0.5) GTEST_SKIP() << dir.path() << " keeps evicted pages (tmpfs?) or has no mincore";
  const uint64_t begin = f->RowOffset(f->Get("w"), 0);
  f->Prefetch(begin, n);
  double now = 0;
  for (int i = 0; i < 600 && now < 0.99; ++i) {  // the reads complete in the background: up to 30 s
    now = ResidentFraction(path, f->file_size());
    if (now < 0.99) usleep(50 * 1000);
  }
  EXPECT_GE(now, 0.99) << "resident after Prefetch of the whole tensor (was " << cold << " cold)";
}

}  // namespace
}  // namespace shardcast
