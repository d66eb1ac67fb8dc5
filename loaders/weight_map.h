// loaders/weight_map: what Checkpoint::Open needs of the index besides ParseWeightMap (checkpoint.h):
// reading it through the descriptor it was opened with, and its keys and names as messages show them.
// Internal to loaders/.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "loaders/posix_file.h"

namespace shardcast::weight_map {

// A key or file name from the index as it appears in messages: control bytes (NUL included) as \xNN,
// at most 200 bytes.
std::string Printable(std::string_view s);
// "weight_map['<key>'] names \"<name>\""
std::string Names(const std::string& key, const std::string& name);
// The index's text; kCheckpoint naming `index_path` when it is not a regular file or is over
// kMaxIndexBytes (checked on fstat's size before anything is read).
std::string ReadIndex(const OpenNode& node, const std::string& index_path);

// The weight_map as Checkpoint::Open holds it while it opens the files: each file name once (an index
// of 90k keys names 163 files; a std::string of the name beside every key was 7 MB).
struct Table {
  std::vector<std::string> names;                      // distinct, in the order `keys` first names them
  std::vector<std::pair<std::string, uint32_t>> keys;  // sorted and unique; second indexes names
};
// ParseWeightMap (checkpoint.h), same rules and errors, of the text ReadIndex read: the text is freed as
// soon as the fast parser has accepted it, and the parser reads it in place (no padded copy), so that
// at most the tree and the table are held at once.
Table ParseIndex(std::string_view index_path, std::string text);

}  // namespace shardcast::weight_map
