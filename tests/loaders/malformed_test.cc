// The malformed-file corpus: one file per validation rule plus the classic parser bugs. Each must be
// a kCheckpoint error that names the problem, never a crash (the sanitizer build runs this too).
// With SHARDCAST_CORPUS_DIR set, the images are also written there to seed the fuzzer.
#include <gtest/gtest.h>

#include <cstdlib>
#include <vector>

#include "loaders/safetensors_file.h"
#include "tests/loaders/test_util.h"

namespace shardcast {
namespace {

using testing::Image;

struct Case {
  const char* name;
  std::string image;
  std::vector<const char*> expect;  // substrings of the message
};

std::string T(const char* key, const char* dtype, const char* shape, const char* offsets) {
  return std::string("\"") + key + "\":{\"dtype\":\"" + dtype + "\",\"shape\":" + shape +
         ",\"data_offsets\":" + offsets + "}";
}

std::string LengthPrefix(uint64_t n) {
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((n >> (8 * i)) & 0xff);
  return out;
}

std::vector<Case> Corpus() {
  const std::string ok_a = T("a", "F32", "[2]", "[0,8]");
  return {
      {"too_short", "\x05\x00\x00", {"too small"}},
      {"header_length_over_cap", LengthPrefix(100'000'001) + "{}", {"exceeds the limit", "100000000"}},
      {"header_length_past_eof", LengthPrefix(64) + "{}", {"claims bytes [8, 72)", "only 10 bytes"}},
      {"header_length_huge", LengthPrefix(~0ull) + "{}", {"exceeds the limit"}},
      {"not_object_start", Image("[]", ""), {"does not start with '{'"}},
      {"leading_space", Image(" {}", ""), {"does not start with '{'"}},
      {"empty_header", Image("", ""), {"does not start with '{'"}},
      {"non_utf8", Image("{\"a\xff\":{}}", ""), {"not valid UTF-8", "byte 11"}},
      {"overlong_utf8", Image("{\"\xc0\x80\":{}}", ""), {"not valid UTF-8"}},
      {"utf16_surrogate", Image("{\"\xed\xa0\x80\":{}}", ""), {"not valid UTF-8"}},
      {"truncated_json", Image("{\"a\":{\"dtype\":", ""), {"not valid JSON"}},
      {"trailing_garbage", Image("{} x", ""), {"not valid JSON"}},
      {"trailing_nul", Image(std::string("{}\0\0", 4), ""), {"not valid JSON"}},
      {"duplicate_key", Image("{" + ok_a + "," + T("a", "F32", "[2]", "[8,16]") + "}", std::string(16, 'x')),
       {"duplicate key 'a'"}},
      {"duplicate_metadata", Image(R"({"__metadata__":{},"__metadata__":{}})", ""), {"duplicate key '__metadata__'"}},
      {"duplicate_metadata_key", Image(R"({"__metadata__":{"k":"1","k":"2"}})", ""), {"duplicate __metadata__ key 'k'"}},
      {"metadata_not_map", Image(R"({"__metadata__":[1]})", ""), {"__metadata__ must be a string-to-string map"}},
      {"metadata_value_not_string", Image(R"({"__metadata__":{"k":1}})", ""), {"__metadata__ must be a string-to-string map"}},
      {"unknown_dtype", Image("{" + T("w", "F128", "[2]", "[0,8]") + "}", std::string(8, 'x')),
       {"tensor 'w'", "unknown dtype \"F128\""}},
      {"dtype_not_string", Image(R"({"w":{"dtype":4,"shape":[2],"data_offsets":[0,8]}})", std::string(8, 'x')),
       {"tensor 'w'", "unexpected number"}},
      {"negative_dim", Image("{" + T("w", "F32", "[-2]", "[0,8]") + "}", std::string(8, 'x')),
       {"tensor 'w'", "negative number -2"}},
      {"float_dim", Image("{" + T("w", "F32", "[1.5]", "[0,8]") + "}", std::string(8, 'x')),
       {"tensor 'w'", "shape holds 1.5"}},
      {"dim_beyond_u64", Image("{" + T("w", "F32", "[18446744073709551616]", "[0,8]") + "}", std::string(8, 'x')),
       {"tensor 'w'", "not a non-negative 64-bit integer"}},
      {"shape_not_array", Image(R"({"w":{"dtype":"F32","shape":2,"data_offsets":[0,8]}})", std::string(8, 'x')),
       {"tensor 'w'", "unexpected number"}},
      {"three_offsets", Image("{" + T("w", "F32", "[2]", "[0,8,8]") + "}", std::string(8, 'x')),
       {"tensor 'w'", "exactly 2 numbers"}},
      {"one_offset", Image("{" + T("w", "F32", "[2]", "[0]") + "}", std::string(8, 'x')),
       {"tensor 'w'", "exactly 2 numbers"}},
      {"begin_after_end", Image("{" + T("w", "F32", "[2]", "[8,0]") + "}", std::string(8, 'x')),
       {"tensor 'w'", "bytes [8, 0)", "end before they begin"}},
      {"size_mismatch", Image("{" + T("w", "F32", "[3]", "[0,8]") + "}", std::string(8, 'x')),
       {"tensor 'w'", "needs 12 bytes", "bytes [0, 8)"}},
      {"shape_overflow", Image("{" + T("w", "F32", "[4294967296,4294967296,2]", "[0,8]") + "}", std::string(8, 'x')),
       {"tensor 'w'", "overflows"}},
      {"shape_overflow_wraps_to_zero", Image("{" + T("w", "F32", "[4294967296,1073741824]", "[0,0]") + "}", ""),
       {"tensor 'w'", "overflows"}},
      {"gap", Image("{" + T("a", "F32", "[2]", "[0,8]") + "," + T("b", "F32", "[2]", "[12,20]") + "}", std::string(20, 'x')),
       {"tensor 'b'", "leaves a gap", "after tensor 'a'"}},
      {"overlap", Image("{" + T("a", "F32", "[2]", "[0,8]") + "," + T("b", "F32", "[2]", "[4,12]") + "}", std::string(12, 'x')),
       {"tensor 'b'", "overlaps"}},
      {"not_starting_at_zero", Image("{" + T("a", "F32", "[2]", "[4,12]") + "}", std::string(12, 'x')),
       {"tensor 'a'", "leaves a gap", "start of the data area"}},
      {"trailing_bytes", Image("{" + ok_a + "}", std::string(9, 'x')), {"trailing bytes", "bytes [0, 9)"}},
      {"data_truncated", Image("{" + ok_a + "}", std::string(7, 'x')), {"truncated", "bytes [0, 8)"}},
      {"missing_dtype", Image(R"({"w":{"shape":[2],"data_offsets":[0,8]}})", std::string(8, 'x')),
       {"tensor 'w'", "missing field \"dtype\""}},
      {"missing_offsets", Image(R"({"w":{"dtype":"F32","shape":[2]}})", std::string(8, 'x')),
       {"tensor 'w'", "missing field \"data_offsets\""}},
      {"duplicate_field", Image(R"({"w":{"dtype":"F32","dtype":"F32","shape":[2],"data_offsets":[0,8]}})", std::string(8, 'x')),
       {"tensor 'w'", "duplicate field \"dtype\""}},
      {"tensor_not_object", Image(R"({"w":5})", ""), {"tensor 'w'", "unexpected number"}},
      {"offset_float", Image("{" + T("w", "F32", "[2]", "[0,8.0]") + "}", std::string(8, 'x')),
       {"tensor 'w'", "data_offsets holds 8.0"}},
  };
}

class Malformed : public ::testing::TestWithParam<size_t> {};

TEST_P(Malformed, IsACheckpointErrorNamingTheProblem) {
  static const std::vector<Case> corpus = Corpus();
  const Case& c = corpus[GetParam()];
  SCOPED_TRACE(c.name);
  const char* dump = std::getenv("SHARDCAST_CORPUS_DIR");
  if (dump != nullptr) testing::WriteFile(std::string(dump) + "/" + c.name, c.image);
  testing::TempDir dir;
  const std::string path = dir / (std::string(c.name) + ".safetensors");
  testing::WriteFile(path, c.image);
  for (ReadMode mode : {ReadMode::kMmap, ReadMode::kPread}) {
    try {
      SafetensorsFile::Open(path, OpenOptions{mode});
      ADD_FAILURE() << c.name << " was accepted";
    } catch (const Error& e) {
      std::string msg = e.what();
      EXPECT_EQ(e.kind(), ErrorKind::kCheckpoint) << msg;
      EXPECT_NE(msg.find(path), std::string::npos) << "message lacks the file: " << msg;
      for (const char* s : c.expect) EXPECT_NE(msg.find(s), std::string::npos) << "lacks \"" << s << "\": " << msg;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Corpus, Malformed, ::testing::Range<size_t>(0, Corpus().size()),
                         [](const ::testing::TestParamInfo<size_t>& info) { return std::string(Corpus()[info.param].name); });

TEST(MalformedCorpus, HasAtLeast25Cases) { EXPECT_GE(Corpus().size(), 25u); }

}  // namespace
}  // namespace shardcast
