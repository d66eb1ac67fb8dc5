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
