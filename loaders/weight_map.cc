// loaders/weight_map.cc: the index (model.safetensors.index.json): read through its descriptor, parsed
// into its weight_map (simdjson first, the diagnosing SAX parser for whatever that declines), and its
// keys and names as they appear in messages. Checkpoint::Open (checkpoint.cc) is its one user.
#include "loaders/weight_map.h"

#include <algorithm>
#include <cstdio>
#include <optional>
#include <unordered_map>
#include <nlohmann/json.hpp>

#include "allocators/error.h"
#include "loaders/checkpoint.h"

#if SHARDCAST_HAVE_SIMDJSON
#include <simdjson.h>
#endif

namespace shardcast {
namespace {

[[noreturn]] void Fail(std::string_view where, const std::string& what) {
  throw Error(ErrorKind::kCheckpoint, std::string(where), what);
}

}  // namespace

namespace weight_map {

// A key or file name from the index as it appears in messages: control bytes (NUL included, which
// would cut a C string short) as \xNN, and at most 200 bytes.
std::string Printable(std::string_view s) {
  std::string out;
  for (unsigned char c : s.substr(0, 200)) {
    if (c < 0x20 || c == 0x7f) {
      char buf[5];
      std::snprintf(buf, sizeof(buf), "\\x%02x", c);
      out += buf;
    } else {
      out += static_cast<char>(c);
    }
  }
  return s.size() > 200 ? out + "..." : out;
}

// "weight_map['<key>'] names \"<name>\""
std::string Names(const std::string& key, const std::string& name) {
  return "weight_map['" + Printable(key) + "'] names \"" + Printable(name) + "\"";
}

// The index, read through the one descriptor it was opened with; the size cap is checked on
// fstat's size before anything is read.
std::string ReadIndex(const OpenNode& node, const std::string& index_path) {
  RequireRegularFile(node.st.st_mode, index_path);
  const auto size = static_cast<uint64_t>(node.st.st_size);
  if (size > kMaxIndexBytes) {
    Fail(index_path, "is " + std::to_string(size) + " bytes, over the limit of " + std::to_string(kMaxIndexBytes));
  }
  return ReadWholeFile(node.fd.get(), size, index_path);
}

}  // namespace weight_map

namespace {

using weight_map::Names;
using weight_map::Printable;

// A file name from an index must be a plain relative path: not empty, no NUL, not absolute, and no
// ".." component. Symlinks are resolved when the file is opened, beneath the checkpoint's root.
// Returns why `name` is not one, or nullptr.
const char* RelativeNameProblem(std::string_view name) {
  if (name.empty()) return "empty file name";
  if (name.find('\0') != std::string_view::npos) return "file name contains NUL";
  if (name[0] == '/') return "absolute path escapes the checkpoint directory";
  for (size_t begin = 0; begin <= name.size();) {
    const size_t end = std::min(name.find('/', begin), name.size());
    if (name.substr(begin, end - begin) == "..") return "path escapes the checkpoint directory";
    begin = end + 1;
  }
  return nullptr;
}

void CheckRelativeName(std::string_view index_path, const std::string& key, const std::string& name) {
  if (const char* why = RelativeNameProblem(name)) {
    Fail(index_path, "weight_map['" + Printable(key) + "'] = \"" + Printable(name) + "\": " + why);
  }
}

// Builds the weight_map straight from SAX events, in time linear in the input (n log n in the
// keys of one object): no DOM, and the only strings kept are weight_map's pairs and the keys of the
// objects still open.
//
//   { "metadata": {...},                       depth 1: top-level keys
//     "weight_map": { "<key>": "<file>", ... } depth 2: string pairs, kept
//     "<anything else>": ... }                 deeper: only duplicate keys and the depth cap
//
// Duplicates are found per object, at every level: an object's keys are collected while it is open
// and sorted when it ends, where equal neighbours are duplicates (weight_map's own pairs are sorted
// anyway). Sorting, not hashing: a hash set degrades to quadratic on keys crafted to collide, and
// nlohmann's callback parser, which did this check before, rescanned the parent at every object
// end (20 MB of small objects took 47 s).
class WeightMapSax : public nlohmann::json_sax<nlohmann::json> {
 public:
  explicit WeightMapSax(std::string_view index_path) : index_path_(index_path) {}

  // The pairs sorted by key, or throws the first error seen.
  std::vector<std::pair<std::string, std::string>> Finish() {
    if (!error_.empty()) Fail(index_path_, error_);
    if (!found_) Fail(index_path_, "has no \"weight_map\" object");
    return std::move(pairs_);
  }

  bool null() override { return NotAString(); }
  bool boolean(bool) override { return NotAString(); }
  bool number_integer(number_integer_t) override { return NotAString(); }
  bool number_unsigned(number_unsigned_t) override { return NotAString(); }
  bool number_float(number_float_t, const string_t&) override { return NotAString(); }
  bool binary(binary_t&) override { return NotAString(); }
  bool string(string_t& s) override {
    if (!InWeightMap()) return NotAString();
    CheckRelativeName(index_path_, wm_key_, s);
    pairs_.emplace_back(std::move(wm_key_), std::move(s));
    return true;
  }

  bool start_object(std::size_t) override {
    if (depth_ == 0) return Enter();  // the document
    if (depth_ == 1 && top_key_ == "weight_map") {
      found_ = true;
      wm_open_ = true;
      return Enter();
    }
    return NotAString() && Enter();
  }
  bool key(string_t& k) override {
    if (depth_ == 1 && k == "weight_map" && found_) return Bad("duplicate key 'weight_map'");
    if (depth_ == 1) top_key_ = k;
    if (InWeightMap()) {
      wm_key_ = std::move(k);  // checked for duplicates with the pairs, at the end
    } else {
      levels_[depth_ - 1].push_back(std::move(k));
    }
    return true;
  }
  bool end_object() override {
    if (InWeightMap()) {
      wm_open_ = false;
      std::sort(pairs_.begin(), pairs_.end());
      for (size_t i = 1; i < pairs_.size(); ++i) {
        if (pairs_[i].first == pairs_[i - 1].first) {
          return Bad("duplicate key '" + Printable(pairs_[i].first) + "'");
        }
      }
    } else {
      std::vector<std::string>& keys = levels_[depth_ - 1];
      std::sort(keys.begin(), keys.end());
      auto dup = std::adjacent_find(keys.begin(), keys.end());
      if (dup != keys.end()) return Bad("duplicate key '" + Printable(*dup) + "'");
    }
    return Leave();
  }
  bool start_array(std::size_t) override { return NotAString() && Enter(); }
  bool end_array() override { return Leave(); }

  bool parse_error(std::size_t position, const std::string&, const nlohmann::detail::exception& ex) override {
    return Bad("not valid JSON at byte " + std::to_string(position) + ": " + ex.what());
  }

 private:
  bool InWeightMap() const { return wm_open_ && depth_ == 2; }

  // Any value but a string, or any value but an object where weight_map's object belongs: wrong
  // inside weight_map, as the value of "weight_map", and as the whole document.
  bool NotAString() {
    if (InWeightMap()) return Bad("weight_map['" + Printable(wm_key_) + "'] is not a file name string");
    if (depth_ == 0 || (depth_ == 1 && top_key_ == "weight_map")) return Bad("has no \"weight_map\" object");
    return true;
  }
  // Levels are reused, not freed, so a million small objects cost no allocation each.
  bool Enter() {
    if (depth_ >= static_cast<size_t>(kMaxIndexDepth)) {
      return Bad("nested deeper than " + std::to_string(kMaxIndexDepth) + " levels");
    }
    if (levels_.size() <= depth_) levels_.emplace_back();
    levels_[depth_].clear();
    ++depth_;
    return true;
  }
  bool Leave() {
    --depth_;
    std::vector<std::string>& keys = levels_[depth_];
    // Give back a big object's keys now rather than keep them as capacity.
    if (keys.capacity() > 4096) std::vector<std::string>().swap(keys);
    keys.clear();
    return true;
  }
  bool Bad(const std::string& what) {
    if (error_.empty()) error_ = what;
    return false;
  }

  std::string_view index_path_;
  // levels_[d]: the keys of the container at depth d + 1 while depth_ > d (empty for an array).
  std::vector<std::vector<std::string>> levels_;
  size_t depth_ = 0;      // containers open
  std::string top_key_;   // the last key of the top-level object
  std::string wm_key_;    // the last key inside weight_map
  bool wm_open_ = false;  // the open depth-2 container is weight_map's object
  bool found_ = false;    // a top-level "weight_map" object was seen
  std::vector<std::pair<std::string, std::string>> pairs_;
  std::string error_;
};

// The table of sorted, unique (key, name) pairs.
template <typename Pairs>
weight_map::Table TableOf(const Pairs& pairs) {
  weight_map::Table t;
  t.keys.reserve(pairs.size());
  std::unordered_map<std::string_view, uint32_t> by_name;  // views of the pairs' names
  for (const auto& [key, name] : pairs) {
    auto [it, fresh] = by_name.emplace(name, static_cast<uint32_t>(t.names.size()));
    if (fresh) t.names.emplace_back(name);
    t.keys.emplace_back(key, it->second);
  }
  return t;
}

#if SHARDCAST_HAVE_SIMDJSON
// ---- the fast path --------------------------------------------------------------------------------
// simdjson's DOM parser (validating, ~1 GB/s here against nlohmann's ~65 MB/s) and one walk of its
// tree that accepts only an index every rule above accepts. It names no problem: whatever it declines
// (invalid JSON, a duplicate key, nesting past kMaxIndexDepth, a bad name, no weight_map) is parsed
// again by WeightMapSax, which decides and names it. So it may decline more than it must, never accept
// more; tests/loaders/weight_map_test.cc and the index fuzzer check the two agree.
using WeightMapViews = std::vector<std::pair<std::string_view, std::string_view>>;

// Sorts `keys` and says whether they are all different (sorting, not hashing: see WeightMapSax).
template <typename T, typename Key>
bool SortedUnique(std::vector<T>* items, Key key) {
  auto less = [&](const T& a, const T& b) { return key(a) < key(b); };
  if (!std::is_sorted(items->begin(), items->end(), less)) std::sort(items->begin(), items->end(), less);
  return std::adjacent_find(items->begin(), items->end(), [&](const T& a, const T& b) { return key(a) == key(b); }) ==
         items->end();
}

// Any value below the top level: no duplicate key in any object, at most kMaxIndexDepth containers.
bool FastValue(simdjson::dom::element v, int depth) {
  if (v.is_object()) {
    if (depth + 1 > kMaxIndexDepth) return false;
    std::vector<std::string_view> keys;
    for (simdjson::dom::key_value_pair kv : simdjson::dom::object(v)) {
      if (!FastValue(kv.value, depth + 1)) return false;
      keys.push_back(kv.key);
    }
    return SortedUnique(&keys, [](std::string_view k) { return k; });
  }
  if (v.is_array()) {
    if (depth + 1 > kMaxIndexDepth) return false;
    for (simdjson::dom::element x : simdjson::dom::array(v)) {
      if (!FastValue(x, depth + 1)) return false;
    }
  }
  return true;
}

// The table, or nullopt for the diagnosing parser to decide. `owned`, when given, holds `json` with at
// least SIMDJSON_PADDING bytes of capacity past its end: it is parsed in place and freed once accepted.
std::optional<weight_map::Table> ParseWeightMapFast(std::string_view json, std::string* owned) {
  simdjson::dom::parser parser;
  simdjson::dom::element doc;
  simdjson::dom::object top;
  const bool padded = owned != nullptr && owned->capacity() >= owned->size() + simdjson::SIMDJSON_PADDING;
  if (parser.parse(json.data(), json.size(), /*realloc_if_needed=*/!padded).get(doc) || doc.get_object().get(top)) {
    return std::nullopt;
  }
  WeightMapViews pairs;
  std::vector<std::string_view> top_keys;
  bool found = false;
  for (simdjson::dom::key_value_pair kv : top) {
    top_keys.push_back(kv.key);
    if (kv.key != "weight_map") {
      if (!FastValue(kv.value, 1)) return std::nullopt;
      continue;
    }
    simdjson::dom::object map;
    if (found || kv.value.get_object().get(map)) return std::nullopt;
    found = true;
    pairs.reserve(map.size());
    for (simdjson::dom::key_value_pair entry : map) {
      std::string_view name;
      if (entry.value.get_string().get(name) || RelativeNameProblem(name) != nullptr) return std::nullopt;
      pairs.emplace_back(entry.key, name);
    }
  }
  if (!found || !SortedUnique(&top_keys, [](std::string_view k) { return k; }) ||
      !SortedUnique(&pairs, [](const auto& p) { return p.first; })) {
    return std::nullopt;
  }
  if (owned != nullptr) std::string().swap(*owned);  // the tree holds its own copy of every string
  return TableOf(pairs);
}
#else
std::optional<weight_map::Table> ParseWeightMapFast(std::string_view, std::string*) {
  return std::nullopt;  // built without simdjson: the diagnosing parser only
}
#endif

}  // namespace

namespace {

void CheckIndexText(std::string_view index_path, std::string_view json) {
  if (json.size() > kMaxIndexBytes) {
    Fail(index_path, "is " + std::to_string(json.size()) + " bytes, over the limit of " + std::to_string(kMaxIndexBytes));
  }
  // nlohmann's lexer takes a NUL byte for the end of input, so "{...}\0junk" would pass as valid.
  if (size_t nul = json.find('\0'); nul != std::string_view::npos) {
    Fail(index_path, "not valid JSON: NUL byte at byte " + std::to_string(nul));
  }
}

std::vector<std::pair<std::string, std::string>> ParseWithSax(std::string_view index_path, std::string_view json) {
  WeightMapSax sax(index_path);
  nlohmann::json::sax_parse(json.begin(), json.end(), &sax, nlohmann::json::input_format_t::json, true);
  return sax.Finish();
}

}  // namespace

std::vector<std::pair<std::string, std::string>> ParseWeightMap(std::string_view index_path, std::string_view json) {
  CheckIndexText(index_path, json);
  std::optional<weight_map::Table> fast = ParseWeightMapFast(json, nullptr);
  if (!fast) return ParseWithSax(index_path, json);
  std::vector<std::pair<std::string, std::string>> out;
  out.reserve(fast->keys.size());
  for (auto& [key, name] : fast->keys) out.emplace_back(std::move(key), fast->names[name]);
  return out;
}

namespace weight_map {

Table ParseIndex(std::string_view index_path, std::string text) {
  CheckIndexText(index_path, text);
#if SHARDCAST_HAVE_SIMDJSON
  text.reserve(text.size() + simdjson::SIMDJSON_PADDING);
#endif
  if (std::optional<Table> fast = ParseWeightMapFast(text, &text)) return std::move(*fast);
  return TableOf(ParseWithSax(index_path, text));
}

}  // namespace weight_map

std::vector<std::pair<std::string, std::string>> ParseWeightMapDiagnosing(std::string_view index_path,
                                                                          std::string_view json) {
  CheckIndexText(index_path, json);
  return ParseWithSax(index_path, json);
}

}  // namespace shardcast
