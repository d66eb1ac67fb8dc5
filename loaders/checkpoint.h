// loaders/checkpoint: a checkpoint directory (or one file), with every tensor looked up by key.
//
// Accepts, in this order (transformers' order): a path to one .safetensors file; a directory holding
// model.safetensors; a directory holding model.safetensors.index.json (its "weight_map" names the
// files). Every file named by the index must exist and be a regular file, and its name
// must be a plain relative path (not empty, no NUL, not absolute, no ".." component). Every name in
// the directory (the index and model.safetensors too) resolves beneath a root, race-free
// (posix_file.h's OpenNodeBeneath): symlinks are followed only while they stay beneath it. The root is
// the directory itself, or for a Hugging Face hub snapshot (<cache>/models--org--name/snapshots/<rev>,
// a directory of symlinks into ../../blobs) its repo folder models--org--name. A name that resolves
// outside the root, or a symlink loop, is kCheckpoint naming the file. A path that names one file is
// the user's own choice and is opened as given. Every file (the directory and the index too) is opened exactly once,
// without blocking on a FIFO, checked through its descriptor (a regular file, and its size), and
// read only through that descriptor, so what is read is what was validated even if names change
// meanwhile. Every key is unique across files, and every key of the weight_map is in the file it
// names.
//
// Thread safety: immutable after Open; const methods are safe from any thread.
// Failure: Open throws shardcast::Error (kCheckpoint naming the file and key, or kIo).
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "loaders/key_index.h"
#include "loaders/posix_file.h"
#include "loaders/safetensors_file.h"

namespace shardcast {

namespace weight_map {
struct Table;  // loaders/weight_map.h
}

inline constexpr const char* kIndexFileName = "model.safetensors.index.json";
inline constexpr const char* kSingleFileName = "model.safetensors";
// "model.safetensors" or "model-NNNNN-of-NNNNN.safetensors": the names a Hugging Face model's weight files
// have (the files a save or synth replaces; any other .safetensors file is not the model's).
bool IsModelFileName(const std::string& name);
// The largest index accepted. DeepSeek-V3's (92k keys) is ~9 MB.
inline constexpr uint64_t kMaxIndexBytes = 256ull << 20;
// The deepest nesting of objects and arrays accepted in an index, the top-level object included.
// Real indexes nest 2 or 3 levels.
inline constexpr int kMaxIndexDepth = 64;

class Checkpoint {
 public:
  struct Entry {
    const SafetensorsFile* file;
    const TensorInfo* info;
    size_t key_index = 0;  // the key's position in keys(): a dense id, for per-key marks
  };

  static std::unique_ptr<Checkpoint> Open(const std::string& path, const OpenOptions& options = {});

  // A file another process has opened with Open: its name relative to the checkpoint (the file's own
  // name for a single-file checkpoint), size and header digest.
  struct KnownFile {
    std::string name;
    uint64_t size = 0;
    uint64_t digest = 0;
  };
  // The setup a second rank pays: opens exactly `files`, by name beneath the same root and with the
  // same rules as Open, without reading the index and without parsing any header whose digest is the
  // known one (OpenOptions::known_header_digest). The result has files and no keys: Find finds nothing;
  // bytes are addressed by the offsets the first process resolved. A file whose size or digest differs
  // is still opened (its header parsed and validated in full): the caller compares and names it.
  static std::unique_ptr<Checkpoint> OpenKnown(const std::string& path, const std::vector<KnownFile>& files,
                                               OpenOptions options = {});

  const std::string& root() const { return root_; }  // the directory, or the file's path
  size_t num_files() const { return files_.size(); }
  const SafetensorsFile& file(size_t i) const { return *files_[i]; }
  // Every tensor's key, sorted: key(i) is the key of key_index i. keys() copies them all (for tools and
  // tests); key(i) and num_keys() copy nothing.
  size_t num_keys() const { return entries_.size(); }
  std::string_view key(size_t i) const { return entries_[i].info->key; }
  std::vector<std::string> keys() const;
  uint64_t total_bytes() const;

  const Entry* Find(std::string_view key) const;
  const Entry& Get(std::string_view key) const;  // throws kCheckpoint naming the key

 private:
  void AddFile(std::unique_ptr<SafetensorsFile> f) { files_.push_back(std::move(f)); }
  // entries_ from the index's keys (sorted): each must be in the file it names, by_name[i] the file of
  // map.names[i]. Returns false, with entries_ to be rebuilt by IndexAllTensors, when the files hold
  // tensors the index does not list.
  bool IndexPairs(const std::string& index, const weight_map::Table& map,
                  const std::vector<const SafetensorsFile*>& by_name);
  // entries_ from every file's tensors; throws kCheckpoint naming both files for a key in two files.
  void IndexAllTensors();
  void BuildKeyIndex();  // index_ from entries_, which are sorted by key

  std::string root_;
  std::vector<std::unique_ptr<SafetensorsFile>> files_;
  // Every tensor, sorted by key (entries_[i].key_index == i), and looked up through index_. The keys are
  // the TensorInfo's own, which files_ owns and never moves: no key is copied (92k at DeepSeek-V3's scale).
  std::vector<Entry> entries_;
  KeyIndex index_;
};

// Parses an index.json's weight_map (key -> file name) with every rule above that needs no file
// system: JSON, no duplicate keys in any object, string values, names that are plain relative
// paths; at most kMaxIndexBytes and kMaxIndexDepth. Returns the pairs sorted by key. Linear in the
// input (n log n in the keys of one object): no JSON tree is built. Throws kCheckpoint naming
// index_path.
std::vector<std::pair<std::string, std::string>> ParseWeightMap(std::string_view index_path,
                                                                 std::string_view json);
// ParseWeightMap has two parsers, like ParseHeader (safetensors_header.h): a fast one that accepts and
// names nothing, and this diagnosing one for whatever the fast one declines. For the tests and the
// fuzzer that check the two agree; not for other callers.
std::vector<std::pair<std::string, std::string>> ParseWeightMapDiagnosing(std::string_view index_path,
                                                                          std::string_view json);

// What a process can tell about a checkpoint without opening it (ranks compare it to decide who reads):
// the size of the file Open reads first (model.safetensors, else the index, else `path` itself when it
// is a file), or -1 when this process does not see one.
int64_t ProbeCheckpoint(const std::string& path);

// Opens `name` of the checkpoint directory `dir` beneath its root, as Checkpoint::Open opens the
// directory's files (config.json, or a header read elsewhere). nullopt: no such name. Throws
// kCheckpoint for a `dir` that is not a directory, a name that resolves outside the root or a loop.
std::optional<OpenNode> OpenCheckpointName(const std::string& dir, const std::string& name);

}  // namespace shardcast
