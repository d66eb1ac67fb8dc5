#include "loaders/checkpoint.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <optional>
#include <nlohmann/json.hpp>
#include <sstream>

#include "allocators/error.h"
#include "loaders/posix_file.h"

#if SHARDCAST_HAVE_SIMDJSON
#include <simdjson.h>
#endif

namespace shardcast {
namespace {

[[noreturn]] void Fail(std::string_view where, const std::string& what) {
  throw Error(ErrorKind::kCheckpoint, std::string(where), what);
}

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

// The pairs sorted by key, or nullopt for the diagnosing parser to decide.
std::optional<std::vector<std::pair<std::string, std::string>>> ParseWeightMapFast(std::string_view json) {
  simdjson::dom::parser parser;
  simdjson::dom::element doc;
  simdjson::dom::object top;
  if (parser.parse(json.data(), json.size()).get(doc) || doc.get_object().get(top)) return std::nullopt;
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
  std::vector<std::pair<std::string, std::string>> out;
  out.reserve(pairs.size());
  for (const auto& [key, name] : pairs) out.emplace_back(key, name);
  return out;
}
#else
std::optional<std::vector<std::pair<std::string, std::string>>> ParseWeightMapFast(std::string_view) {
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
  if (auto fast = ParseWeightMapFast(json)) return std::move(*fast);
  return ParseWithSax(index_path, json);
}

std::vector<std::pair<std::string, std::string>> ParseWeightMapDiagnosing(std::string_view index_path,
                                                                          std::string_view json) {
  CheckIndexText(index_path, json);
  return ParseWithSax(index_path, json);
}

namespace {

// Where the names of a checkpoint directory resolve beneath (see checkpoint.h).
//
//   <cache>/models--org--name/          root of a hub snapshot   prefix "snapshots/<rev>/"
//     blobs/<sha>
//     snapshots/<rev>/  <- dir          root of any other dir    prefix ""
struct NameRoot {
  UniqueFd fd;
  std::string path;    // the root, as messages name it
  std::string prefix;  // the directory relative to the root
};

// The directory's path as the kernel sees it, or the path given where /proc is not mounted.
std::string CanonicalPath(int fd, const std::string& given) {
  std::string buf(4096, '\0');
  const ssize_t n = readlink(("/proc/self/fd/" + std::to_string(fd)).c_str(), buf.data(), buf.size());
  if (n <= 0 || static_cast<size_t>(n) == buf.size()) return given;
  buf.resize(static_cast<size_t>(n));
  return buf;
}

std::vector<std::string> Components(const std::string& path) {
  std::vector<std::string> out;
  std::stringstream ss(path);
  std::string part;
  while (std::getline(ss, part, '/')) {
    if (!part.empty() && part != ".") out.push_back(part);
  }
  return out;
}

bool IsHubRepoName(const std::string& name) {
  for (const char* kind : {"models--", "datasets--", "spaces--"}) {
    if (name.rfind(kind, 0) == 0 && name.size() > std::string(kind).size()) return true;
  }
  return false;
}

// The root for the directory `dir` (opened from `path`): its hub repo folder when it is
// <repo>/snapshots/<rev> and that folder's snapshots/<rev> is this very directory, else itself.
NameRoot RootOf(OpenNode dir, const std::string& path) {
  const std::string canonical = CanonicalPath(dir.fd.get(), path);
  const std::vector<std::string> parts = Components(canonical);
  const size_t n = parts.size();
  if (n >= 3 && parts[n - 2] == "snapshots" && IsHubRepoName(parts[n - 3])) {
    const std::string prefix = "snapshots/" + parts[n - 1];
    UniqueFd repo(::openat(dir.fd.get(), "../..", O_RDONLY | O_DIRECTORY | O_CLOEXEC));
    std::string repo_path = canonical.substr(0, canonical.rfind("/snapshots/"));
    if (repo.get() >= 0) {
      std::optional<OpenNode> again = OpenNodeBeneath(repo.get(), repo_path, prefix, path);
      if (again && again->st.st_dev == dir.st.st_dev && again->st.st_ino == dir.st.st_ino) {
        return NameRoot{std::move(repo), std::move(repo_path), prefix + "/"};
      }
    }
  }
  return NameRoot{std::move(dir.fd), path, ""};
}

NameRoot RootOfDirectory(const std::string& dir) {
  std::optional<OpenNode> node = OpenNodeAt(AT_FDCWD, dir, dir);
  if (!node) Fail(dir, "no such file or directory");
  if (!S_ISDIR(node->st.st_mode)) Fail(dir, "is " + std::string(FileKindText(node->st.st_mode)) + ", not a directory");
  return RootOf(std::move(*node), dir);
}

std::optional<OpenNode> OpenBeneath(const NameRoot& root, const std::string& dir, const std::string& name) {
  return OpenNodeBeneath(root.fd.get(), root.path, root.prefix + name, dir + "/" + name);
}

// The checkpoint's path, opened once: a directory becomes the root its names resolve beneath; a regular
// file (the user named it: it may be a symlink anywhere) is the checkpoint's only file; anything else
// is rejected.
struct Top {
  std::optional<NameRoot> dir;
  std::unique_ptr<SafetensorsFile> file;
};

Top OpenTop(const std::string& path, const OpenOptions& options) {
  std::optional<OpenNode> top = OpenNodeAt(AT_FDCWD, path, path);
  if (!top) Fail(path, "no such file or directory");
  Top out;
  if (S_ISDIR(top->st.st_mode)) {
    out.dir.emplace(RootOf(std::move(*top), path));
  } else {
    RequireRegularFile(top->st.st_mode, path);
    out.file = SafetensorsFile::FromDescriptor(top->fd.release(), path, options);
  }
  return out;
}

}  // namespace

int64_t ProbeCheckpoint(const std::string& path) {
  struct stat st;
  if (stat(path.c_str(), &st) != 0) return -1;
  if (S_ISREG(st.st_mode)) return st.st_size;
  if (!S_ISDIR(st.st_mode)) return -1;
  for (const char* name : {kIndexFileName, kSingleFileName}) {
    if (stat((path + "/" + name).c_str(), &st) == 0 && S_ISREG(st.st_mode)) return st.st_size;
  }
  return -1;
}

std::optional<OpenNode> OpenCheckpointName(const std::string& dir, const std::string& name) {
  return OpenBeneath(RootOfDirectory(dir), dir, name);
}

// Every file is opened exactly once, beneath the root's descriptor, and read only through its own
// descriptor from then on (see posix_file.h). The path itself is opened once too: one that names a
// directory is used through that descriptor, one that names a regular file is the checkpoint's only
// file (the user named it: it may be a symlink anywhere), and anything else is rejected.
std::unique_ptr<Checkpoint> Checkpoint::Open(const std::string& path, const OpenOptions& options) {
  std::unique_ptr<Checkpoint> ckpt(new Checkpoint());
  ckpt->root_ = path;
  Top top = OpenTop(path, options);
  if (top.file) {
    ckpt->AddFile(std::move(top.file));
    ckpt->SortKeys();
    return ckpt;
  }
  const NameRoot& root = *top.dir;
  if (const std::string index = path + "/" + kIndexFileName;
      std::optional<OpenNode> index_node = OpenBeneath(root, path, kIndexFileName)) {
    auto weight_map = ParseWeightMap(index, ReadIndex(*index_node, index));
    index_node.reset();
    // Pairs sorted by key name runs of one file (a file holds a block of layers): the file of the
    // previous pair is looked up again only when the name changes.
    std::unordered_map<std::string_view, const SafetensorsFile*> by_name;
    ckpt->entries_.reserve(weight_map.size());  // one allocation: DeepSeek-V3 lists 92k keys
    const std::string* last_name = nullptr;
    for (const auto& [key, name] : weight_map) {
      if (last_name != nullptr && name == *last_name) continue;
      last_name = &name;
      auto [it, fresh] = by_name.emplace(name, nullptr);
      if (!fresh) continue;
      std::optional<OpenNode> node = OpenBeneath(root, path, name);
      if (!node) Fail(index, Names(key, name) + ", which does not exist");
      ckpt->AddFile(SafetensorsFile::FromDescriptor(node->fd.release(), path + "/" + name, options));
      it->second = ckpt->files_.back().get();
    }
    // Every pair's key must be in the file it names: keys are unique across files, so that is its entry
    // naming that file. When the index lists every key the files hold, as it does, its pairs (sorted by
    // key) are keys() already and nothing needs sorting again.
    const bool lists_every_key = ckpt->entries_.size() == weight_map.size();
    if (lists_every_key) ckpt->keys_.reserve(weight_map.size());
    last_name = nullptr;
    const SafetensorsFile* file = nullptr;
    for (auto& [key, name] : weight_map) {
      if (last_name == nullptr || name != *last_name) file = by_name.at(name), last_name = &name;
      auto it = ckpt->entries_.find(key);
      if (it == ckpt->entries_.end() || it->second.file != file) {
        Fail(index, Names(key, name) + ", which holds no tensor '" + Printable(key) + "'");
      }
      if (lists_every_key) {
        it->second.key_index = ckpt->keys_.size();
        ckpt->keys_.push_back(std::move(key));
      }
    }
    if (lists_every_key) return ckpt;
  } else if (std::optional<OpenNode> single_node = OpenBeneath(root, path, kSingleFileName)) {
    ckpt->AddFile(SafetensorsFile::FromDescriptor(single_node->fd.release(), path + "/" + kSingleFileName, options));
  } else {
    Fail(path, std::string("holds neither ") + kIndexFileName + " nor " + kSingleFileName);
  }
  ckpt->SortKeys();
  return ckpt;
}

std::unique_ptr<Checkpoint> Checkpoint::OpenKnown(const std::string& path, const std::vector<KnownFile>& files,
                                                  OpenOptions options) {
  std::unique_ptr<Checkpoint> ckpt(new Checkpoint());
  ckpt->root_ = path;
  OpenOptions single = options;  // used only when the path names one file
  if (files.size() == 1) single.known_header_digest = files[0].digest;
  Top top = OpenTop(path, single);
  if (top.file) {
    ckpt->AddFile(std::move(top.file));
    ckpt->SortKeys();
    return ckpt;
  }
  const NameRoot& root = *top.dir;
  for (const KnownFile& known : files) {
    std::optional<OpenNode> node = OpenBeneath(root, path, known.name);
    if (!node) Fail(path + "/" + known.name, "no such file (the first rank's checkpoint has it)");
    options.known_header_digest = known.digest;
    ckpt->AddFile(SafetensorsFile::FromDescriptor(node->fd.release(), path + "/" + known.name, options));
  }
  ckpt->SortKeys();
  return ckpt;
}

void Checkpoint::AddFile(std::unique_ptr<SafetensorsFile> f) {
  for (const TensorInfo& t : f->header().tensors) {
    auto [it, inserted] = entries_.emplace(t.key, Entry{f.get(), &t});
    if (!inserted) {
      Fail(f->path(), "tensor '" + t.key + "' is also in " + it->second.file->path() +
                          "; every key must be unique across files");
    }
  }
  files_.push_back(std::move(f));
}

void Checkpoint::SortKeys() {
  std::vector<Entry*> order;
  order.reserve(entries_.size());
  for (auto& [key, e] : entries_) order.push_back(&e);
  std::sort(order.begin(), order.end(), [](const Entry* a, const Entry* b) { return a->info->key < b->info->key; });
  keys_.clear();
  keys_.reserve(order.size());
  for (Entry* e : order) {
    e->key_index = keys_.size();
    keys_.push_back(e->info->key);
  }
}

uint64_t Checkpoint::total_bytes() const {
  uint64_t total = 0;
  for (const auto& f : files_) total += f->header().data_bytes;
  return total;
}

const Checkpoint::Entry* Checkpoint::Find(std::string_view key) const {
  auto it = entries_.find(key);
  return it == entries_.end() ? nullptr : &it->second;
}

const Checkpoint::Entry& Checkpoint::Get(std::string_view key) const {
  const Entry* e = Find(key);
  if (e == nullptr) Fail(root_, "no tensor '" + std::string(key) + "' in the checkpoint");
  return *e;
}

}  // namespace shardcast
