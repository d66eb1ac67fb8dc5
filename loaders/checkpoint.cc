#include "loaders/checkpoint.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <optional>
#include <regex>
#include <nlohmann/json.hpp>
#include <sstream>

#include "allocators/error.h"
#include "loaders/posix_file.h"
#include "loaders/weight_map.h"


namespace shardcast {
namespace {

[[noreturn]] void Fail(std::string_view where, const std::string& what) {
  throw Error(ErrorKind::kCheckpoint, std::string(where), what);
}

}  // namespace

using weight_map::Names;
using weight_map::Printable;
using weight_map::ReadIndex;

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

bool IsModelFileName(const std::string& name) {
  if (name == kSingleFileName) return true;
  static const std::regex kShard("model-[0-9]{5}-of-[0-9]{5}\\.safetensors");
  return std::regex_match(name, kShard);
}

int64_t ProbeCheckpoint(const std::string& path) {
  struct stat st;
  if (stat(path.c_str(), &st) != 0) return -1;
  if (S_ISREG(st.st_mode)) return st.st_size;
  if (!S_ISDIR(st.st_mode)) return -1;
  for (const char* name : {kSingleFileName, kIndexFileName}) {  // the file Open reads first
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
    ckpt->IndexAllTensors();
    return ckpt;
  }
  const NameRoot& root = *top.dir;
  // model.safetensors first, then the index, as transformers chooses: a directory holding both (a repo
  // whose weights were re-saved in one file, an output written over) loads what transformers loads.
  if (std::optional<OpenNode> single_node = OpenBeneath(root, path, kSingleFileName)) {
    ckpt->AddFile(SafetensorsFile::FromDescriptor(single_node->fd.release(), path + "/" + kSingleFileName, options));
  } else if (const std::string index = path + "/" + kIndexFileName;
             std::optional<OpenNode> index_node = OpenBeneath(root, path, kIndexFileName)) {
    const weight_map::Table weight_map = weight_map::ParseIndex(index, ReadIndex(*index_node, index));
    index_node.reset();
    // Each name is opened once, in the order the sorted keys first name it (the first key that names
    // one that does not exist is the one the error names).
    std::vector<const SafetensorsFile*> by_name(weight_map.names.size(), nullptr);
    for (const auto& [key, name] : weight_map.keys) {
      if (by_name[name] != nullptr) continue;
      const std::string& file_name = weight_map.names[name];
      std::optional<OpenNode> node = OpenBeneath(root, path, file_name);
      if (!node) Fail(index, Names(key, file_name) + ", which does not exist");
      ckpt->AddFile(SafetensorsFile::FromDescriptor(node->fd.release(), path + "/" + file_name, options));
      by_name[name] = ckpt->files_.back().get();
    }
    if (ckpt->IndexPairs(index, weight_map, by_name)) return ckpt;
  } else {
    Fail(path, std::string("holds neither ") + kIndexFileName + " nor " + kSingleFileName);
  }
  ckpt->IndexAllTensors();
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
    ckpt->IndexAllTensors();
    return ckpt;
  }
  const NameRoot& root = *top.dir;
  for (const KnownFile& known : files) {
    std::optional<OpenNode> node = OpenBeneath(root, path, known.name);
    if (!node) Fail(path + "/" + known.name, "no such file (the first rank's checkpoint has it)");
    options.known_header_digest = known.digest;
    ckpt->AddFile(SafetensorsFile::FromDescriptor(node->fd.release(), path + "/" + known.name, options));
  }
  ckpt->IndexAllTensors();
  return ckpt;
}

// Every pair's key must be in the file it names. Pairs sorted by key name runs of one file (a file holds
// a block of layers): the file is looked up again only when the name changes. When the index lists every
// tensor the files hold, as it does, its pairs are entries_ in key order already, and no key can be in two
// files (each pair found one tensor, and no two pairs share a key).
bool Checkpoint::IndexPairs(const std::string& index, const weight_map::Table& map,
                            const std::vector<const SafetensorsFile*>& by_name) {
  size_t tensors = 0;
  for (const auto& f : files_) tensors += f->header().tensors.size();
  entries_.clear();
  entries_.reserve(map.keys.size());
  for (const auto& [key, name] : map.keys) {
    const SafetensorsFile* file = by_name[name];
    const TensorInfo* info = file->Find(key);
    if (info == nullptr) {
      IndexAllTensors();  // a key in two files is the first problem, as it always was
      Fail(index, Names(key, map.names[name]) + ", which holds no tensor '" + Printable(key) + "'");
    }
    entries_.push_back(Entry{file, info, entries_.size()});
  }
  if (entries_.size() != tensors) return false;
  BuildKeyIndex();
  return true;
}

void Checkpoint::IndexAllTensors() {
  entries_.clear();
  for (const auto& f : files_) {
    for (const TensorInfo& t : f->header().tensors) entries_.push_back(Entry{f.get(), &t, 0});
  }
  // Stable: of a key in two files, the one opened first comes first, and the second is named.
  std::stable_sort(entries_.begin(), entries_.end(),
                   [](const Entry& a, const Entry& b) { return a.info->key < b.info->key; });
  for (size_t i = 0; i < entries_.size(); ++i) {
    if (i > 0 && entries_[i].info->key == entries_[i - 1].info->key) {
      Fail(entries_[i].file->path(), "tensor '" + entries_[i].info->key + "' is also in " +
                                         entries_[i - 1].file->path() + "; every key must be unique across files");
    }
    entries_[i].key_index = i;
  }
  BuildKeyIndex();
}

void Checkpoint::BuildKeyIndex() {
  index_.Build(entries_.size(), [&](size_t i) -> std::string_view { return entries_[i].info->key; });
}

std::vector<std::string> Checkpoint::keys() const {
  std::vector<std::string> out;
  out.reserve(entries_.size());
  for (const Entry& e : entries_) out.push_back(e.info->key);
  return out;
}

uint64_t Checkpoint::total_bytes() const {
  uint64_t total = 0;
  for (const auto& f : files_) total += f->header().data_bytes;
  return total;
}

const Checkpoint::Entry* Checkpoint::Find(std::string_view key) const {
  const size_t i = index_.Find(key, [&](size_t j) -> std::string_view { return entries_[j].info->key; });
  return i == KeyIndex::npos ? nullptr : &entries_[i];
}

const Checkpoint::Entry& Checkpoint::Get(std::string_view key) const {
  const Entry* e = Find(key);
  if (e == nullptr) Fail(root_, "no tensor '" + std::string(key) + "' in the checkpoint");
  return *e;
}

}  // namespace shardcast
