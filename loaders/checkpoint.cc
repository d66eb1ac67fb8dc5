#include "loaders/checkpoint.h"

#include <fcntl.h>
#include <sys/stat.h>

#include <algorithm>
#include <climits>
#include <cstdlib>
#include <map>
#include <optional>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "allocators/error.h"
#include "loaders/posix_file.h"

namespace shardcast {
namespace {

[[noreturn]] void Fail(std::string_view where, const std::string& what) {
  throw Error(ErrorKind::kCheckpoint, std::string(where), what);
}

bool IsDirectory(const std::string& p) {
  struct stat st;
  return stat(p.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}
bool Exists(const std::string& p) {
  struct stat st;
  return stat(p.c_str(), &st) == 0;
}

std::string RealPath(const std::string& p) {
  char buf[PATH_MAX];
  if (realpath(p.c_str(), buf) == nullptr) return {};
  return buf;
}

// The index, read through the one descriptor it was opened with: a FIFO does not block, and the
// size cap is checked on fstat's size before anything is read.
std::string ReadIndexFile(const std::string& path, uint64_t limit) {
  std::optional<OpenNode> node = OpenNodeAt(AT_FDCWD, path, path);
  if (!node) Fail(path, "no such file");
  RequireRegularFile(node->st.st_mode, path);
  const auto size = static_cast<uint64_t>(node->st.st_size);
  if (size > limit) Fail(path, "is " + std::to_string(size) + " bytes, over the limit of " + std::to_string(limit));
  return ReadWholeFile(node->fd.get(), size, path);
}

// A file name from an index must be a plain relative path that stays below the directory.
void CheckRelativeName(std::string_view index_path, const std::string& key, const std::string& name) {
  auto bad = [&](const std::string& why) {
    Fail(index_path, "weight_map['" + key + "'] = \"" + name + "\": " + why);
  };
  if (name.empty()) bad("empty file name");
  if (name.find('\0') != std::string::npos) bad("file name contains NUL");
  if (name[0] == '/') bad("absolute path escapes the checkpoint directory");
  std::stringstream ss(name);
  std::string part;
  while (std::getline(ss, part, '/')) {
    if (part == "..") bad("path escapes the checkpoint directory");
  }
}

}  // namespace

std::vector<std::pair<std::string, std::string>> ParseWeightMap(std::string_view index_path, std::string_view json) {
  // Reject duplicate keys at every level: a DOM parse would silently keep the last one.
  std::vector<std::set<std::string>> seen;
  std::string duplicate;
  auto on_event = [&](int, nlohmann::json::parse_event_t ev, nlohmann::json& parsed) {
    using E = nlohmann::json::parse_event_t;
    if (ev == E::object_start) seen.emplace_back();
    if (ev == E::object_end && !seen.empty()) seen.pop_back();
    if (ev == E::key && !seen.empty() && !seen.back().insert(parsed.get<std::string>()).second &&
        duplicate.empty()) {
      duplicate = parsed.get<std::string>();
    }
    return true;
  };
  nlohmann::json doc;
  try {
    doc = nlohmann::json::parse(json.begin(), json.end(), on_event);
  } catch (const nlohmann::json::exception& e) {
    Fail(index_path, std::string("not valid JSON: ") + e.what());
  }
  if (!duplicate.empty()) Fail(index_path, "duplicate key '" + duplicate + "'");
  if (!doc.is_object() || !doc.contains("weight_map") || !doc["weight_map"].is_object()) {
    Fail(index_path, "has no \"weight_map\" object");
  }
  std::vector<std::pair<std::string, std::string>> out;
  for (auto& [key, value] : doc["weight_map"].items()) {
    if (!value.is_string()) Fail(index_path, "weight_map['" + key + "'] is not a file name string");
    std::string name = value.get<std::string>();
    CheckRelativeName(index_path, key, name);
    out.emplace_back(key, std::move(name));
  }
  return out;
}

std::unique_ptr<Checkpoint> Checkpoint::Open(const std::string& path, const OpenOptions& options) {
  std::unique_ptr<Checkpoint> ckpt(new Checkpoint());
  ckpt->root_ = path;
  if (!Exists(path)) throw Error(ErrorKind::kCheckpoint, path, "no such file or directory");
  if (!IsDirectory(path)) {
    ckpt->AddFile(SafetensorsFile::Open(path, options));
  } else if (std::string index = path + "/" + kIndexFileName; Exists(index)) {
    auto weight_map = ParseWeightMap(index, ReadIndexFile(index, 1ull << 30));
    const std::string real_root = RealPath(path);
    std::map<std::string, size_t> file_pos;
    for (const auto& [key, name] : weight_map) {
      if (file_pos.count(name)) continue;
      std::string full = path + "/" + name;
      if (!Exists(full)) Fail(index, "weight_map['" + key + "'] names \"" + name + "\", which does not exist");
      std::string real = RealPath(full);
      if (real.compare(0, real_root.size() + 1, real_root + "/") != 0) {
        Fail(index, "weight_map['" + key + "'] names \"" + name + "\", which resolves to " + real +
                        ", outside the checkpoint directory");
      }
      file_pos[name] = ckpt->files_.size();
      ckpt->AddFile(SafetensorsFile::Open(full, options));
    }
    for (const auto& [key, name] : weight_map) {
      const SafetensorsFile& f = *ckpt->files_[file_pos[name]];
      if (f.Find(key) == nullptr) {
        Fail(index, "weight_map['" + key + "'] names \"" + name + "\", which holds no tensor '" + key + "'");
      }
    }
  } else if (std::string single = path + "/" + kSingleFileName; Exists(single)) {
    ckpt->AddFile(SafetensorsFile::Open(single, options));
  } else {
    Fail(path, std::string("holds neither ") + kIndexFileName + " nor " + kSingleFileName);
  }
  std::sort(ckpt->keys_.begin(), ckpt->keys_.end());
  return ckpt;
}

void Checkpoint::AddFile(std::unique_ptr<SafetensorsFile> f) {
  for (const TensorInfo& t : f->header().tensors) {
    auto [it, inserted] = entries_.emplace(t.key, Entry{f.get(), &t});
    if (!inserted) {
      Fail(f->path(), "tensor '" + t.key + "' is also in " + it->second.file->path() +
                          "; every key must be unique across files");
    }
    keys_.push_back(t.key);
  }
  files_.push_back(std::move(f));
}

uint64_t Checkpoint::total_bytes() const {
  uint64_t total = 0;
  for (const auto& f : files_) total += f->header().data_bytes;
  return total;
}

const Checkpoint::Entry* Checkpoint::Find(std::string_view key) const {
  auto it = entries_.find(std::string(key));
  return it == entries_.end() ? nullptr : &it->second;
}

const Checkpoint::Entry& Checkpoint::Get(std::string_view key) const {
  const Entry* e = Find(key);
  if (e == nullptr) Fail(root_, "no tensor '" + std::string(key) + "' in the checkpoint");
  return *e;
}

}  // namespace shardcast
