// Conformance with files written by the reference safetensors library (../shared, present in CI).
// Every tensor there is numpy.array(range(-3, 3)) cast to its dtype, with metadata {"test": "a"}.
#include <gtest/gtest.h>

#include <cstring>
#include <map>

#include "loaders/safetensors_file.h"
#include "tests/loaders/test_util.h"

namespace shardcast {
namespace {

template <typename T>
void ExpectRange(const SafetensorsFile& f, const TensorInfo& t) {
  ASSERT_EQ(t.shape, std::vector<uint64_t>{6});
  for (ReadMode mode : {ReadMode::kMmap, ReadMode::kPread}) {
    T got[6];
    if (mode == ReadMode::kMmap) {
      ByteSpan v = f.View(t);
      ASSERT_EQ(v.size, sizeof(got));
      std::memcpy(got, v.data, sizeof(got));  // the data area is unaligned: never dereference in place
    } else {
      auto p = SafetensorsFile::Open(f.path(), OpenOptions{ReadMode::kPread});
      p->ReadRows(p->Get(t.key), 0, 6, got);
    }
    for (int i = 0; i < 6; ++i) EXPECT_EQ(got[i], static_cast<T>(i - 3)) << t.key << "[" << i << "]";
  }
}

void ExpectHalf(const SafetensorsFile& f, const TensorInfo& t) {
  uint16_t got[6];
  f.ReadRows(t, 0, 6, got);
  const uint16_t want[6] = {0xC200, 0xC000, 0xBC00, 0x0000, 0x3C00, 0x4000};  // -3 .. 2 in IEEE half
  for (int i = 0; i < 6; ++i) EXPECT_EQ(got[i], want[i]) << i;
}

void CheckTensor(const SafetensorsFile& f, const TensorInfo& t) {
  switch (t.dtype) {
    case DType::kU8: ExpectRange<uint8_t>(f, t); break;
    case DType::kI8: ExpectRange<int8_t>(f, t); break;
    case DType::kU16: ExpectRange<uint16_t>(f, t); break;
    case DType::kI16: ExpectRange<int16_t>(f, t); break;
    case DType::kU32: ExpectRange<uint32_t>(f, t); break;
    case DType::kI32: ExpectRange<int32_t>(f, t); break;
    case DType::kF32: ExpectRange<float>(f, t); break;
    case DType::kF64: ExpectRange<double>(f, t); break;
    case DType::kF16: ExpectHalf(f, t); break;
    default: ADD_FAILURE() << "unexpected dtype in samples: " << DTypeName(t.dtype);
  }
}

class Samples : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = testing::SharedDir();
    if (dir_.empty()) GTEST_SKIP() << "../shared/data/safetensors-samples is absent; CI has it";
    dir_ += "/data/safetensors-samples/";
  }
  std::string dir_;
};

TEST_F(Samples, EverySingleFileReadsExactly) {
  const std::map<std::string, DType> files = {
      {"B", DType::kU8}, {"H", DType::kU16}, {"I", DType::kU32}, {"b", DType::kI8}, {"d", DType::kF64},
      {"e", DType::kF16}, {"f", DType::kF32}, {"h", DType::kI16}, {"i", DType::kI32}};
  for (const auto& [key, dtype] : files) {
    SCOPED_TRACE(key);
    auto f = SafetensorsFile::Open(dir_ + key + ".safetensors");
    ASSERT_EQ(f->header().tensors.size(), 1u);
    const TensorInfo& t = f->Get(key);
    EXPECT_EQ(t.dtype, dtype);
    ASSERT_EQ(f->header().metadata.size(), 1u);
    EXPECT_EQ(f->header().metadata[0], (std::pair<std::string, std::string>{"test", "a"}));
    CheckTensor(*f, t);
  }
}

TEST_F(Samples, OverallHoldsAllNineUnalignedAndByKey) {
  auto f = SafetensorsFile::Open(dir_ + "overall.safetensors");
  EXPECT_EQ(f->header().tensors.size(), 9u);
  EXPECT_NE(f->header().data_offset() % 8, 0u) << "the samples are meant to start unaligned";
  for (const char* key : {"B", "H", "I", "b", "d", "e", "f", "h", "i"}) {
    SCOPED_TRACE(key);
    CheckTensor(*f, f->Get(key));
  }
}

}  // namespace
}  // namespace shardcast
