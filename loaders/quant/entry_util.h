// loaders/quant/entry_util: what the format entries share (internal to loaders/quant): key suffixes,
// where a checkpoint tensor's bytes start, and how a message names a tensor.
#pragma once

#include <string>
#include <string_view>

#include "loaders/checkpoint.h"
#include "loaders/dtype.h"
#include "loaders/quant/format.h"
#include "loaders/shape.h"

namespace shardcast::quant_internal {

inline bool EndsWith(std::string_view s, std::string_view suffix) {
  return s.size() > suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

inline std::string Strip(std::string_view s, std::string_view suffix) {
  return std::string(s.substr(0, s.size() - suffix.size()));
}

// The absolute offset of `e`'s data in its file.
inline uint64_t DataOffset(const Checkpoint::Entry& e) { return e.file->header().data_offset() + e.info->begin; }

// "'key' DTYPE [shape]", as the pairing errors name a tensor.
inline std::string TensorText(const Checkpoint::Entry& e, const std::string& key) {
  return "'" + key + "' " + std::string(DTypeName(e.info->dtype)) + " " + ShapeText(e.info->shape);
}

// For a format that stores the model's tensor under the model's key, in the model's shape.
inline std::string SameKey(const std::string&) { return ""; }
inline std::vector<uint64_t> SameShape(const std::vector<uint64_t>& shape) { return shape; }

inline QuantMatch Match(const QuantFormat& f, QuantPiece piece, std::string data_key, std::string model_key,
                        std::string partner, bool complete) {
  return QuantMatch{&f, piece, std::move(data_key), std::move(model_key), std::move(partner), complete};
}

}  // namespace shardcast::quant_internal
