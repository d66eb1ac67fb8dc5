#include "loaders/safetensors_header.h"

#include <gtest/gtest.h>

#include "tests/loaders/test_util.h"

namespace shardcast {
namespace {

using testing::Image;

Header Parse(const std::string& json, const std::string& data) {
  std::string img = Image(json, data);
  return ParseFileImage("t.safetensors", reinterpret_cast<const unsigned char*>(img.data()), img.size());
}

TEST(Header, ParsesTensorsMetadataAndOffsets) {
  Header h = Parse(R"({"__metadata__":{"format":"pt"},"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]},)"
                   R"("a":{"dtype":"U8","shape":[2,2],"data_offsets":[0,4]}})",
                   std::string(12, 'x'));
  ASSERT_EQ(h.tensors.size(), 2u);
  EXPECT_EQ(h.tensors[0].key, "b");  // header order kept
  const TensorInfo* a = h.Find("a");
  ASSERT_NE(a, nullptr);
  EXPECT_EQ(a->dtype, DType::kU8);
  EXPECT_EQ(a->shape, (std::vector<uint64_t>{2, 2}));
  EXPECT_EQ(a->rows(), 2u);
  EXPECT_EQ(a->row_bytes(), 2u);
  ASSERT_EQ(h.metadata.size(), 1u);
  EXPECT_EQ(h.metadata[0].first, "format");
  EXPECT_EQ(h.data_bytes, 12u);
  EXPECT_EQ(h.Find("missing"), nullptr);
}

TEST(Header, AcceptsEmptyHeaderTrailingSpacesNullMetadataAndZeroSizedTensors) {
  EXPECT_EQ(Parse("{}", "").tensors.size(), 0u);
  EXPECT_EQ(Parse("{}      ", "").tensors.size(), 0u);
  EXPECT_EQ(Parse(R"({"__metadata__":null})", "").tensors.size(), 0u);
  Header h = Parse(R"({"z":{"dtype":"F32","shape":[0,4],"data_offsets":[0,0]},)"
                   R"("s":{"dtype":"F64","shape":[],"data_offsets":[0,8]}})",
                   std::string(8, '\0'));
  EXPECT_EQ(h.Find("z")->numel(), 0u);
  EXPECT_EQ(h.Find("s")->rows(), 1u);  // 0-dim: one row holding everything
  EXPECT_EQ(h.Find("s")->row_bytes(), 8u);
}

TEST(Header, IgnoresUnknownTensorFieldsLikeTheReference) {
  Header h = Parse(R"({"a":{"dtype":"U8","extra":{"x":[1,{"y":null}]},"shape":[1],"data_offsets":[0,1],"z":true}})",
                   "x");
  EXPECT_EQ(h.Find("a")->nbytes(), 1u);
}

TEST(Header, AcceptsUtf8Keys) {
  Header h = Parse("{\"gr\xC3\xBC\xC3\x9F\xE2\x82\xAC\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1]}}", "x");
  EXPECT_NE(h.Find("gr\xC3\xBC\xC3\x9F\xE2\x82\xAC"), nullptr);
}

// Regression (outside trial): a key holding "\n  [rank 2] ...\u001b[2J" passed into ManifestMismatch's
// text raw, forging a rank's line and clearing the terminal. Control characters (C0, DEL, C1) in a key
// are refused by both parsers, the key shown with '?' for them; other non-ASCII keys stay fine.
TEST(Header, RefusesKeysHoldingControlCharacters) {
  const std::string tail = R"(":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}})";
  for (const std::string& key : {std::string("a\\n  [rank 2] forged"), std::string("x\\u001b[2J"),
                                 std::string("del\\u007f"), std::string("c1\\u0085"), std::string("\\t")}) {
    SCOPED_TRACE(key);
    const std::string json = "{\"" + key + tail;
    const std::string img = Image(json, "x");
    EXPECT_SC_ERROR(Parse(json, "x"), ErrorKind::kCheckpoint, "t.safetensors", "a tensor key holds a control character");
    EXPECT_SC_ERROR(ParseHeaderDiagnosing("t.safetensors", json, img.size()), ErrorKind::kCheckpoint,
                    "a tensor key holds a control character");
  }
  EXPECT_SC_ERROR(Parse("{\"a\\n[rank 2]" + tail, "x"), ErrorKind::kCheckpoint, "tensor 'a?[rank 2]'", "offset 1");
  EXPECT_NE(Parse("{\"\xC2\xA0nbsp\xC2\xBF" + tail, "x").Find("\xC2\xA0nbsp\xC2\xBF"), nullptr);  // not C1
}

}  // namespace
}  // namespace shardcast
