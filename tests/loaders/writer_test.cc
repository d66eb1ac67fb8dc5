#include "loaders/writer.h"

#include <gtest/gtest.h>
#include <sys/stat.h>

#include <cstring>
#include <random>

#include "loaders/checkpoint.h"
#include "tests/loaders/test_util.h"

namespace shardcast {
namespace {

std::vector<unsigned char> RandomBytes(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<unsigned char> v(n);
  for (auto& b : v) b = static_cast<unsigned char>(rng());
  return v;
}

TEST(Writer, EveryDTypeRoundTripsBitExactlyWithAlignedData) {
  testing::TempDir dir;
  std::vector<WriteEntry> entries;
  std::vector<std::vector<unsigned char>> data;
  for (int i = 0; i < kNumDTypes; ++i) {
    DType d = static_cast<DType>(i);
    entries.push_back({"t." + std::string(DTypeName(d)), d, {3, static_cast<uint64_t>(i + 1)}});
    data.push_back(RandomBytes(entries.back().nbytes(), i));
  }
  entries.push_back({"scalar", DType::kF64, {}});
  data.push_back(RandomBytes(8, 99));
  entries.push_back({"empty", DType::kBF16, {0, 7}});
  data.push_back({});
  const std::string path = dir / "x.safetensors";
  SafetensorsWriter w(path, entries, {{"k", "v"}});
  for (const auto& d : data) w.Append(d.data(), d.size());
  w.Commit();

  for (ReadMode mode : {ReadMode::kMmap, ReadMode::kPread}) {
    auto f = SafetensorsFile::Open(path, OpenOptions{mode});
    EXPECT_EQ(f->header().data_offset() % 8, 0u);
    EXPECT_EQ(f->header().metadata, (Metadata{{"k", "v"}}));
    for (size_t i = 0; i < entries.size(); ++i) {
      const TensorInfo& t = f->Get(entries[i].key);
      EXPECT_EQ(t.dtype, entries[i].dtype);
      EXPECT_EQ(t.shape, entries[i].shape);
      std::vector<unsigned char> got(t.nbytes());
      f->ReadRows(t, 0, t.rows(), got.data());
      EXPECT_EQ(got, data[i]) << entries[i].key;
    }
  }
}

TEST(Writer, NothingUnderTheFinalNameUntilCommit) {
  testing::TempDir dir;
  const std::string path = dir / "x.safetensors";
  {
    SafetensorsWriter w(path, {{"a", DType::kF32, {4}}});
    float v[2] = {1, 2};
    w.Append(v, sizeof(v));
    struct stat st;
    EXPECT_NE(stat(path.c_str(), &st), 0);
    EXPECT_SC_ERROR(w.Commit(), ErrorKind::kInvalidArgument, "commit after 8 of 16");
  }  // destroyed uncommitted
  EXPECT_EQ(testing::ReadFile(path), "");
  EXPECT_EQ(std::system(("test -z \"$(ls -A '" + dir.path() + "')\"").c_str()), 0) << "temp file left behind";
}

TEST(Writer, RejectsAppendPastTheDeclaredSizeAndDuplicateKeys) {
  testing::TempDir dir;
  SafetensorsWriter w(dir / "x.safetensors", {{"a", DType::kU8, {2}}});
  unsigned char b[3] = {1, 2, 3};
  EXPECT_SC_ERROR(w.Append(b, 3), ErrorKind::kInvalidArgument, "past the declared data area");
  EXPECT_SC_ERROR(BuildHeader({{"a", DType::kU8, {1}}, {"a", DType::kU8, {1}}}, {}), ErrorKind::kInvalidArgument,
                  "duplicate");
}

TEST(Writer, ShardsBySizeWithIndexAndReadsBackByKey) {
  testing::TempDir dir;
  std::vector<WriteEntry> entries;
  for (int i = 0; i < 10; ++i) entries.push_back({"w" + std::to_string(i), DType::kF32, {100, 10}});  // 4000 B
  auto source = [](const WriteEntry& e, uint64_t off, unsigned char* out, size_t n) {
    for (size_t i = 0; i < n; ++i) out[i] = static_cast<unsigned char>(e.key.back() + off + i);
  };
  CheckpointWriteOptions opt;
  opt.max_shard_bytes = 10000;
  opt.chunk_bytes = 1024;  // exercise chunking inside a tensor
  WrittenCheckpoint w = WriteCheckpoint(dir.path(), entries, source, opt);
  ASSERT_EQ(w.files.size(), 5u);
  EXPECT_EQ(w.files[0], dir / "model-00001-of-00005.safetensors");
  EXPECT_EQ(w.total_bytes, 40000u);
  auto ckpt = Checkpoint::Open(dir.path());
  EXPECT_EQ(ckpt->num_files(), 5u);
  EXPECT_EQ(ckpt->keys().size(), 10u);
  EXPECT_EQ(ckpt->total_bytes(), 40000u);
  const auto& e = ckpt->Get("w7");
  std::vector<unsigned char> got(4000);
  e.file->ReadRows(*e.info, 0, 100, got.data());
  for (size_t i = 0; i < got.size(); ++i) ASSERT_EQ(got[i], static_cast<unsigned char>('7' + i)) << i;
}

TEST(Writer, FailedSourceLeavesNoFilesBehind) {
  testing::TempDir dir;
  std::vector<WriteEntry> entries = {{"a", DType::kU8, {10}}, {"b", DType::kU8, {10}}};
  auto source = [](const WriteEntry& e, uint64_t, unsigned char*, size_t) {
    if (e.key == "b") throw std::runtime_error("disk on fire");
  };
  CheckpointWriteOptions opt;
  opt.max_shard_bytes = 10;
  EXPECT_THROW(WriteCheckpoint(dir.path(), entries, source, opt), std::runtime_error);
  EXPECT_EQ(std::system(("test -z \"$(ls -A '" + dir.path() + "')\"").c_str()), 0) << "files left behind";
}

TEST(Writer, SparseFilesAreFullSizeHolesThatReadAsZeros) {
  testing::TempDir dir;
  std::vector<WriteEntry> entries = {{"big", DType::kBF16, {1u << 14, 1u << 12}}};  // 128 MiB
  CheckpointWriteOptions opt;
  opt.sparse = true;
  WriteCheckpoint(dir.path(), entries, nullptr, opt);
  struct stat st;
  ASSERT_EQ(stat((dir / "model.safetensors").c_str(), &st), 0);
  EXPECT_GE(static_cast<uint64_t>(st.st_size), 128ull << 20);
  EXPECT_LT(static_cast<uint64_t>(st.st_blocks) * 512, 1ull << 20) << "data area should use no disk";
  auto f = SafetensorsFile::Open(dir / "model.safetensors");
  std::vector<unsigned char> rows(8192, 1);
  f->ReadRows(f->Get("big"), 100, 101, rows.data());
  EXPECT_EQ(rows, std::vector<unsigned char>(8192, 0));
}

}  // namespace
}  // namespace shardcast
