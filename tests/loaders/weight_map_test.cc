// ParseWeightMap: the index.json rules that need no file system, and hostile indexes that must be
// rejected or parsed in linear time. Large inputs run in a child with a deadline, so a parse that
// goes quadratic fails its test instead of running for minutes.
#include <gtest/gtest.h>

#include <chrono>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "loaders/checkpoint.h"
#include "tests/loaders/test_util.h"

namespace shardcast {
namespace {

using testing::ChildOutcome;
using testing::RunInChild;
using Pairs = std::vector<std::pair<std::string, std::string>>;

Pairs Parse(const std::string& json) { return ParseWeightMap("idx.json", json); }

TEST(WeightMap, KeepsOnlyWeightMapStringPairsSortedByKey) {
  EXPECT_EQ(Parse(R"({"metadata":{"total_size":12,"nested":{"weight_map":{"q":"no.safetensors"}}},
                      "weight_map":{"b":"2.safetensors","a":"1.safetensors","c":"sub/3.safetensors"},
                      "extra":[{"weight_map":7}]})"),
            (Pairs{{"a", "1.safetensors"}, {"b", "2.safetensors"}, {"c", "sub/3.safetensors"}}));
  EXPECT_EQ(Parse(R"({"weight_map":{}})"), Pairs{});
}

TEST(WeightMap, RejectsDuplicateKeysAtEveryLevelButNotAcrossSiblings) {
  EXPECT_SC_ERROR(Parse(R"({"weight_map":{"x":"a","x":"b"}})"), ErrorKind::kCheckpoint, "idx.json", "duplicate key 'x'");
  EXPECT_SC_ERROR(Parse(R"({"weight_map":{},"weight_map":{}})"), ErrorKind::kCheckpoint, "duplicate key 'weight_map'");
  EXPECT_SC_ERROR(Parse(R"({"metadata":{"a":{"k":1,"k":2}},"weight_map":{}})"), ErrorKind::kCheckpoint,
                  "duplicate key 'k'");
  EXPECT_SC_ERROR(Parse(R"({"m":[[{"k":1,"k":1}]],"weight_map":{}})"), ErrorKind::kCheckpoint, "duplicate key 'k'");
  // The same key in sibling objects, or in a parent and its child, is not a duplicate.
  EXPECT_EQ(Parse(R"({"m":[{"k":1},{"k":1}],"k":{"k":{"k":2}},"weight_map":{"k":"f"}})"), (Pairs{{"k", "f"}}));
}

TEST(WeightMap, RejectsWhatIsNotAStringMap) {
  EXPECT_SC_ERROR(Parse(R"([])"), ErrorKind::kCheckpoint, "no \"weight_map\" object");
  EXPECT_SC_ERROR(Parse(R"("weight_map")"), ErrorKind::kCheckpoint, "no \"weight_map\" object");
  EXPECT_SC_ERROR(Parse(R"({"metadata":{}})"), ErrorKind::kCheckpoint, "no \"weight_map\" object");
  EXPECT_SC_ERROR(Parse(R"({"weight_map":["a"]})"), ErrorKind::kCheckpoint, "no \"weight_map\" object");
  EXPECT_SC_ERROR(Parse(R"({"weight_map":null})"), ErrorKind::kCheckpoint, "no \"weight_map\" object");
  for (const char* v : {"7", "null", "true", "[]", "{}", "{\"a\":\"b\"}", "1.5"}) {
    SCOPED_TRACE(v);
    EXPECT_SC_ERROR(Parse(std::string(R"({"weight_map":{"x":)") + v + "}}"), ErrorKind::kCheckpoint,
                    "weight_map['x'] is not a file name string");
  }
  EXPECT_SC_ERROR(Parse(R"({"weight_map":{"x":"a"}} x)"), ErrorKind::kCheckpoint, "not valid JSON");
  EXPECT_SC_ERROR(Parse(std::string(R"({"weight_map":{"x":"a"}})") + '\0' + "junk"), ErrorKind::kCheckpoint,
                  "not valid JSON", "NUL byte at byte 24");
  EXPECT_SC_ERROR(Parse(R"({"weight_map":{"x":"a\uZZZZ"}})"), ErrorKind::kCheckpoint, "not valid JSON");
}

TEST(WeightMap, RejectsNestingDeeperThanTheCap) {
  const std::string deep = std::string(kMaxIndexDepth, '[') + std::string(kMaxIndexDepth, ']');
  EXPECT_SC_ERROR(Parse(R"({"weight_map":{},"m":)" + deep + "}"), ErrorKind::kCheckpoint, "nested deeper than");
  const std::string ok = std::string(kMaxIndexDepth - 1, '[') + std::string(kMaxIndexDepth - 1, ']');
  EXPECT_EQ(Parse(R"({"weight_map":{},"m":)" + ok + "}"), Pairs{});
}

TEST(WeightMap, RejectsAnIndexOverTheSizeCap) {
  std::string big(kMaxIndexBytes + 1, ' ');
  big.replace(0, 16, R"({"weight_map":{})");
  EXPECT_SC_ERROR(Parse(big), ErrorKind::kCheckpoint, "idx.json", "over the limit of 268435456");
}

// A deadline for ~20 MB hostile indexes: a linear parse takes well under a second in Release and a
// few seconds under ASan; the quadratic one took 47 s for 20 MB.
constexpr auto kDeadline = std::chrono::seconds(30);

void ExpectPromptOutcome(const std::string& json, bool accepted, const char* needle) {
  ChildOutcome o = RunInChild([&] { return std::to_string(Parse(json).size()) + " pairs"; }, kDeadline);
  if (accepted) {
    ASSERT_EQ(o.state, ChildOutcome::kReturned) << o.Describe();
  } else {
    ASSERT_EQ(o.state, ChildOutcome::kThrewError) << o.Describe();
  }
  EXPECT_NE(o.message.find(needle), std::string::npos) << o.Describe();
  std::printf("    %.1f MB: %s\n", json.size() / 1e6, o.Describe().c_str());
}

std::string Repeat(const std::string& unit, size_t bytes, const char* sep) {
  std::string out;
  out.reserve(bytes + unit.size() + 1);
  while (out.size() < bytes) {
    if (!out.empty()) out += sep;
    out += unit;
  }
  return out;
}

// Regression: nlohmann's callback parser rescans the parent object at every object end, so an
// index of many small objects parsed in quadratic time (20 MB: 47 s, 40 MB: 219 s).
TEST(WeightMap, TwentyMegabytesOfSmallObjectsParseInLinearTime) {
  ExpectPromptOutcome(R"({"weight_map":{"x":"a.safetensors"},"m":[)" + Repeat("{}", 20'000'000, ",") + "]}", true,
                      "1 pairs");
  ExpectPromptOutcome(R"({"weight_map":{"x":"a.safetensors"},"m":[)" + Repeat(R"({"a":{"b":{}}})", 20'000'000, ",") +
                          "]}",
                      true, "1 pairs");
}

TEST(WeightMap, TwentyMegabytesOfKeysInOneObjectParseInLinearTime) {
  std::string json = R"({"m":{)";
  for (size_t i = 0; json.size() < 20'000'000; ++i) json += "\"k" + std::to_string(i) + "\":{},";
  json += R"("last":{}},"weight_map":{"x":"a.safetensors"}})";
  ExpectPromptOutcome(json, true, "1 pairs");
}

TEST(WeightMap, TwentyMegabytesOfNestingAreRejectedPromptly) {
  ExpectPromptOutcome(R"({"weight_map":{},"m":)" + std::string(20'000'000, '['), false, "nested deeper than");
  ExpectPromptOutcome(R"({"weight_map":{},"m":)" + Repeat(R"({"a":)", 20'000'000, ""), false, "nested deeper than");
}

// DeepSeek-V3's index has ~92k keys in ~9 MB; it must keep parsing, every pair intact.
TEST(WeightMap, ParsesAnIndexAtDeepSeekV3Scale) {
  std::string json = R"({"metadata":{"total_size":688586727753},"weight_map":{)";
  const int n = 92000;
  for (int i = 0; i < n; ++i) {
    json += (i ? "," : "") + std::string("\"model.layers.") + std::to_string(i / 1500) + ".mlp.experts." +
            std::to_string(i % 1500) + ".down_proj.weight_scale_inv\":\"model-" + std::to_string(i / 1400 + 1) +
            "-of-000163.safetensors\"";
  }
  json += "}}";
  Pairs p = Parse(json);
  ASSERT_EQ(p.size(), static_cast<size_t>(n));
  EXPECT_EQ(p.front().first, "model.layers.0.mlp.experts.0.down_proj.weight_scale_inv");
  for (size_t i = 1; i < p.size(); ++i) ASSERT_LT(p[i - 1].first, p[i].first);
}

}  // namespace
}  // namespace shardcast

namespace shardcast {
namespace {

TEST(WeightMap, ADuplicatedWeightMapIsNamedAsTheDuplicate) {
  EXPECT_SC_ERROR(Parse(R"({"weight_map":{"x":"a"},"weight_map":{"x":"a"}})"), ErrorKind::kCheckpoint,
                  "duplicate key 'weight_map'");
}

}  // namespace
}  // namespace shardcast

namespace shardcast {
namespace {

// What ParseWeightMap came to: the pairs, or the error's message.
std::string IndexOutcome(Pairs (*parse)(std::string_view, std::string_view), const std::string& json) {
  try {
    std::string out = "ok";
    for (const auto& [k, v] : parse("idx.json", json)) out += "|" + k + "=" + v;
    return out;
  } catch (const Error& e) {
    return std::string("error ") + e.what();
  }
}

// ParseWeightMap's fast parser only declines what the diagnosing one decides: the same pairs or the same
// error, on hand-written indexes and on ~20k deterministic mutations of them.
TEST(WeightMap, ItsTwoParsersAgree) {
  const std::vector<std::string> valid = {
      R"({"metadata":{"total_size":12,"nested":{"weight_map":{"q":"no.safetensors"}}},)"
      R"("weight_map":{"b":"2.safetensors","a":"1.safetensors","c":"sub/3.safetensors"},"extra":[{"weight_map":7}]})",
      R"({"m":[{"k":1},{"k":1}],"k":{"k":{"k":2}},"weight_map":{"k":"f","e\u00e9":"x/y.safetensors"}})",
      R"({"weight_map":{}})",
  };
  const std::string deep = std::string(kMaxIndexDepth - 1, '[') + std::string(kMaxIndexDepth - 1, ']');
  std::vector<std::string> cases = valid;
  for (const std::string& c : std::vector<std::string>{
           R"({"weight_map":{"x":"a","x":"b"}})", R"({"weight_map":{},"weight_map":{}})",
           R"({"metadata":{"a":{"k":1,"k":2}},"weight_map":{}})", R"({"weight_map":{"x":"../a"}})",
           R"({"weight_map":{"x":"a/../b"}})", R"({"weight_map":{"x":"/a"}})", R"({"weight_map":{"x":""}})",
           R"({"weight_map":{"x":"a\u0000b"}})", R"({"weight_map":{"x":".."}})", R"({"weight_map":{"x":"a/.."}})",
           R"({"weight_map":{"x":"..a/b.."}})", R"({"weight_map":{"x":1}})", R"({"weight_map":[]})", R"([])",
           R"({"weight_map":{"x":"a"},"n":18446744073709551616})", R"({"weight_map":{"x":"a"},"n":1e400})",
           R"({"weight_map":{},"m":)" + deep + "}", R"({"weight_map":{},"m":[)" + deep + "]}",
           R"({"weight_map":{},"m":[[)" + deep + "]]}",
       }) {
    cases.push_back(c);
  }
  for (const std::string& c : cases) {
    EXPECT_EQ(IndexOutcome(&ParseWeightMap, c), IndexOutcome(&ParseWeightMapDiagnosing, c)) << c;
  }
  const std::vector<std::string> tokens = {"\"weight_map\"", "{}", "[]", ",", ":", "\"", "\\", "\\u0000", "\\ud800",
                                           "..", "/", "1.5", "null", "\"k\"", "\"a\":\"b\"", " ", "\xFF"};
  std::mt19937_64 rng(19);
  int accepted = 0;
  for (int i = 0; i < 20000; ++i) {
    std::string json = valid[rng() % valid.size()];
    const int edits = 1 + static_cast<int>(rng() % 3);
    for (int e = 0; e < edits && !json.empty(); ++e) {
      const size_t at = rng() % json.size();
      switch (rng() % 4) {
        case 0: json[at] = "{}[],:\"\\/.01ak "[rng() % 16]; break;
        case 1: json.insert(at, tokens[rng() % tokens.size()]); break;
        case 2: json.erase(at, 1 + rng() % 8); break;
        default: json.insert(at, json.substr(at, 1 + rng() % 24)); break;
      }
    }
    const std::string fast = IndexOutcome(&ParseWeightMap, json);
    ASSERT_EQ(fast, IndexOutcome(&ParseWeightMapDiagnosing, json)) << json;
    accepted += fast.rfind("ok", 0) == 0;
  }
  EXPECT_GT(accepted, 500);
}

}  // namespace
}  // namespace shardcast
