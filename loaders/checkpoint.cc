#include "loaders/checkpoint.h"

#include <fcntl.h>
#include <sys/stat.h>

#include <algorithm>
#include <cstdio>
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
// ".." component. Symlinks are not checked: the directory's owner made them (a hub snapshot's files
// are symlinks into ../../blobs), and each file is opened once and read only through that descriptor.
void CheckRelativeName(std::string_view index_path, const std::string& key, const std::string& name) {
  auto bad = [&](const std::string& why) {
    Fail(index_path, "weight_map['" + Printable(key) + "'] = \"" + Printable(name) + "\": " + why);
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

// Every file is opened exactly once, relative to the directory's descriptor, and read only through
// its own descriptor from then on (see posix_file.h). The directory is opened once too: a path
// that names a directory is used through that descriptor, one that names a regular file is the
// checkpoint's only file, and anything else is rejected.
std::unique_ptr<Checkpoint> Checkpoint::Open(const std::string& path, const OpenOptions& options) {
  std::unique_ptr<Checkpoint> ckpt(new Checkpoint());
  ckpt->root_ = path;
  std::optional<OpenNode> root = OpenNodeAt(AT_FDCWD, path, path);
  if (!root) Fail(path, "no such file or directory");
  if (!S_ISDIR(root->st.st_mode)) {
    RequireRegularFile(root->st.st_mode, path);
    ckpt->AddFile(SafetensorsFile::FromDescriptor(root->fd.release(), path, options));
  } else if (const std::string index = path + "/" + kIndexFileName;
             std::optional<OpenNode> index_node = OpenNodeAt(root->fd.get(), kIndexFileName, index)) {
    auto weight_map = ParseWeightMap(index, ReadIndex(*index_node, index));
    index_node.reset();
    std::unordered_map<std::string, size_t> file_pos;
    for (const auto& [key, name] : weight_map) {
      if (file_pos.count(name)) continue;
      const std::string full = path + "/" + name;
      std::optional<OpenNode> node = OpenNodeAt(root->fd.get(), name, full);
      if (!node) Fail(index, Names(key, name) + ", which does not exist");
      file_pos[name] = ckpt->files_.size();
      ckpt->AddFile(SafetensorsFile::FromDescriptor(node->fd.release(), full, options));
    }
    for (const auto& [key, name] : weight_map) {
      const SafetensorsFile& f = *ckpt->files_[file_pos[name]];
      if (f.Find(key) == nullptr) {
        Fail(index, Names(key, name) + ", which holds no tensor '" + Printable(key) + "'");
      }
    }
  } else if (const std::string single = path + "/" + kSingleFileName;
             std::optional<OpenNode> single_node = OpenNodeAt(root->fd.get(), kSingleFileName, single)) {
    ckpt->AddFile(SafetensorsFile::FromDescriptor(single_node->fd.release(), single, options));
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
