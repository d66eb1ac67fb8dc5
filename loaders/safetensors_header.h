// loaders/safetensors_header: the validating parser for a safetensors header.
//
// A checkpoint is hostile until this says otherwise. The rules are the reference implementation's:
//   - the 8-byte little-endian header length N is at most kMaxHeaderBytes and 8 + N <= file size;
//   - the header is UTF-8 JSON whose first byte is '{' (trailing whitespace allowed);
//   - no key appears twice, at any level;
//   - "__metadata__" is a string-to-string map (or null);
//   - every tensor has a known dtype, a shape of non-negative integers, and data_offsets [begin, end]
//     with begin <= end, numel * element size == end - begin (overflow-checked);
//   - sorted by offset, tensors tile the data area from 0 with no gap or overlap, ending at its end.
// One rule of shardcast's own: a tensor key holds no control character (C0, DEL, C1; JSON escapes such
// as "\u001b" decode to them). Keys reach error messages on every rank and terminals; one holding a
// newline could forge a "[rank N]" line, an escape sequence rewrite the screen. No checkpoint has one.
// Every error is ErrorKind::kCheckpoint and names the file, the key and the byte range involved.
// Pure functions; thread-safe. Each thread keeps one JSON parser's buffers for its next header, sized
// for the largest header it parsed up to 1 MB; a larger one is parsed with buffers freed after.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "loaders/dtype.h"
#include "loaders/key_index.h"

namespace shardcast {

inline constexpr uint64_t kMaxHeaderBytes = 100'000'000;

struct TensorInfo {
  std::string key;
  DType dtype = DType::kU8;
  std::vector<uint64_t> shape;
  uint64_t begin = 0;  // byte offsets relative to the start of the data area
  uint64_t end = 0;

  uint64_t nbytes() const { return end - begin; }
  uint64_t numel() const;
  // Dim-0 rows. A 0-dim tensor is one row holding everything.
  uint64_t rows() const { return shape.empty() ? 1 : shape[0]; }
  uint64_t row_bytes() const;
};

struct Header {
  std::vector<TensorInfo> tensors;  // in header order
  std::vector<std::pair<std::string, std::string>> metadata;
  uint64_t header_bytes = 0;        // N, the JSON length
  uint64_t data_offset() const { return 8 + header_bytes; }
  uint64_t data_bytes = 0;

  const TensorInfo* Find(std::string_view key) const;
  // Fills `index` from tensors. Returns false when a key is there twice.
  bool BuildIndex();
  // key -> position in tensors (key_index.h: no pointers, so a copied Header's index is right). Built by
  // ParseHeader.
  KeyIndex index;
};

// Reads N from the first 8 bytes and checks it against the cap and the file size.
// REQUIRES: prefix has 8 bytes.
uint64_t ParseHeaderLength(std::string_view file, const unsigned char* prefix, uint64_t file_size);

// Validates `json` (the N header bytes) for a file of `file_size` bytes and returns its tensors.
Header ParseHeader(std::string_view file, std::string_view json, uint64_t file_size);

// The whole check on an in-memory file image (used by the fuzzer and tests).
Header ParseFileImage(std::string_view file, const unsigned char* data, size_t size);

// ParseHeader has two parsers: a fast one (simdjson) that accepts well-formed headers and names no
// problem, and a diagnosing one (nlohmann's SAX) for whatever the fast one declines, which decides and
// names the problem. This is ParseHeader with the diagnosing parser alone, for the tests and the fuzzer
// that check the two agree: the same Header, or the same error. Not for other callers.
Header ParseHeaderDiagnosing(std::string_view file, std::string_view json, uint64_t file_size);

// "[begin, end)" as text, for messages.
std::string ByteRangeText(uint64_t begin, uint64_t end);

}  // namespace shardcast
