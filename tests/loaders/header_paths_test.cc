// ParseHeader's two parsers agree: the fast one (simdjson) and the diagnosing one (nlohmann's SAX) give
// the same Header for every header either accepts and the same error for every other, on hand-written
// cases and on ~20k deterministic mutations of valid headers (the fuzzer checks the same on its inputs).
#include <gtest/gtest.h>

#include <random>
#include <string>
#include <vector>

#include "allocators/error.h"
#include "loaders/safetensors_header.h"

namespace shardcast {
namespace {

// What a parse came to: the Header's every field as text, or the error's kind and message.
std::string Outcome(Header (*parse)(std::string_view, std::string_view, uint64_t), const std::string& json,
                    uint64_t data_bytes) {
  try {
    Header h = parse("p.safetensors", json, 8 + json.size() + data_bytes);
    std::string out = "ok " + std::to_string(h.header_bytes) + " " + std::to_string(h.data_bytes) + "\n";
    for (const auto& [k, v] : h.metadata) out += "meta '" + k + "'='" + v + "'\n";
    for (const TensorInfo& t : h.tensors) {
      out += "'" + t.key + "' " + std::to_string(static_cast<int>(t.dtype)) + " [";
      for (uint64_t d : t.shape) out += std::to_string(d) + ",";
      out += "] " + ByteRangeText(t.begin, t.end) + (h.Find(t.key) == &t ? " found\n" : " NOT FOUND\n");
    }
    return out;
  } catch (const Error& e) {
    return "error " + std::to_string(static_cast<int>(e.kind())) + " " + e.what();
  }
}

void ExpectSame(const std::string& json, uint64_t data_bytes) {
  const std::string fast = Outcome(&ParseHeader, json, data_bytes);
  const std::string diagnosing = Outcome(&ParseHeaderDiagnosing, json, data_bytes);
  EXPECT_EQ(fast, diagnosing) << "header: " << json;
}

const char* const kValid[] = {
    R"({"__metadata__":{"format":"pt","x":"y"},"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]},)"
    R"("a":{"dtype":"U8","shape":[2,2],"data_offsets":[0,4]}})",
    R"({"a":{"dtype":"U8","extra":{"x":[1,{"y":null}]},"shape":[1],"data_offsets":[0,1],"z":true},)"
    R"("__metadata__":null,"s":{"dtype":"F64","shape":[],"data_offsets":[1,9]},)"
    R"("z":{"dtype":"BF16","shape":[0,4],"data_offsets":[9,9]}})",
    "{\"gr\xC3\xBC\xC3\x9F\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1]},"
    R"("e\u00e9\"q\\":{"dtype":"I8","shape":[1,1],"data_offsets":[1,2]}}   )",
};
const uint64_t kValidData[] = {12, 9, 2};

TEST(HeaderPaths, AgreeOnValidHeadersAndHandWrittenFaults) {
  for (size_t i = 0; i < std::size(kValid); ++i) ExpectSame(kValid[i], kValidData[i]);
  const std::string t = R"("dtype":"F32","shape":[2],"data_offsets":[0,8])";
  for (const std::string& bad : std::vector<std::string>{
           "{\"w\":{" + t + "},\"w\":{" + t + "}}",                                    // duplicate tensor
           R"({"__metadata__":{},"__metadata__":null})",                              // duplicate metadata
           R"({"__metadata__":{"k":"1","k":"2"}})",                                   // duplicate metadata key
           R"({"__metadata__":{"k":1}})", R"({"__metadata__":[]})", R"({"__metadata__":"x"})",
           R"({"w":{"dtype":"F32","dtype":"F32","shape":[2],"data_offsets":[0,8]}})",  // duplicate field
           R"({"w":{"dtype":"F32","shape":[2.0],"data_offsets":[0,8]}})",
           R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8.0]}})",
           R"({"w":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})",
           R"({"w":{"dtype":"F32","shape":[-0],"data_offsets":[0,0]}})",
           R"({"w":{"dtype":"F32","shape":[18446744073709551616],"data_offsets":[0,8]}})",
           R"({"w":{"dtype":"F32","shape":[18446744073709551615],"data_offsets":[0,8]}})",
           R"({"w":{"dtype":"F32","shape":[-9223372036854775809],"data_offsets":[0,8]}})",
           R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8],"x":18446744073709551616}})",
           R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8],"x":1e400}})",
           R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8],"x":{"a":1,"a":2}}})",
           R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8,8]}})",
           R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0]}})",
           R"({"w":{"dtype":"F32","shape":[2]}})", R"({"w":{}})", R"({"w":5})", R"({"w":null})",
           R"({"w":{"dtype":"F128","shape":[2],"data_offsets":[0,8]}})",
           R"({"w":{"dtype":4,"shape":[2],"data_offsets":[0,8]}})",
           R"({"w":{"dtype":"F32","shape":2,"data_offsets":[0,8]}})",
           R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[8,0]}})",
           R"({"w":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})",
           R"({"w\ud800":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})",
           R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}} x)",
           R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]})",
           R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},})",
           std::string("{\"w\x01\":{") + t + "}}",
           // UTF-8: overlong, surrogate, past U+10FFFF, cut short, and a valid 4-byte sequence.
           "{\"\xc0\x80\":{" + t + "}}", "{\"\xed\xa0\x80\":{" + t + "}}", "{\"\xf4\x90\x80\x80\":{" + t + "}}",
           "{\"\xe2\x82\":{" + t + "}}", "{\"\xf0\x9f\x98\x80\":{" + t + "}}", "{\"\x80\":{" + t + "}}",
           "{\"a\":" + std::string(1100, '[') + std::string(1100, ']') + "}",
           "{\"w\":{" + t + ",\"x\":" + std::string(1100, '[') + std::string(1100, ']') + "}}",
       }) {
    ExpectSame(bad, 8);
  }
}

// Mutations of the valid headers: bytes replaced, tokens inserted, spans deleted or repeated.
TEST(HeaderPaths, AgreeOnMutatedHeaders) {
  const std::vector<std::string> tokens = {
      "1.0", "-1", "-0", "1e3", "18446744073709551616", "18446744073709551615", "null", "true", "\"dtype\"",
      "\"shape\"", "\"data_offsets\"", "\"__metadata__\"", "{}", "[]", ",", ":", "\"", "\\", "\\u0000", "\\ud800",
      "\\udc00\\ud800", "\"F32\"", "[0,8]", "[1]", "{\"a\":1}", " ", "\xC3\xBC", "\xFF", "0", "9"};
  std::mt19937_64 rng(19);
  int accepted = 0;
  for (int i = 0; i < 20000; ++i) {
    const size_t seed = rng() % std::size(kValid);
    std::string json = kValid[seed];
    const int edits = 1 + static_cast<int>(rng() % 3);
    for (int e = 0; e < edits && !json.empty(); ++e) {
      const size_t at = rng() % json.size();
      switch (rng() % 4) {
        case 0: json[at] = "{}[],:\"\\0123456789-.eE ax"[rng() % 25]; break;
        case 1: json.insert(at, tokens[rng() % tokens.size()]); break;
        case 2: json.erase(at, 1 + rng() % 8); break;
        default: json.insert(at, json.substr(at, 1 + rng() % 24)); break;
      }
    }
    const std::string fast = Outcome(&ParseHeader, json, kValidData[seed]);
    ASSERT_EQ(fast, Outcome(&ParseHeaderDiagnosing, json, kValidData[seed])) << "header: " << json;
    accepted += fast.rfind("ok", 0) == 0;
  }
  EXPECT_GT(accepted, 500);  // the mutations reach the accepting path too, not only errors
}

}  // namespace
}  // namespace shardcast
