// loaders/weight_map: what Checkpoint::Open needs of the index besides ParseWeightMap (checkpoint.h):
// reading it through the descriptor it was opened with, and its keys and names as messages show them.
// Internal to loaders/.
#pragma once

#include <string>
#include <string_view>

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

}  // namespace shardcast::weight_map
