// ParseHeader: the checks every header gets (UTF-8, each tensor's bytes, coverage of the data area) and
// the diagnosing parser (nlohmann's SAX), which decides and names the problem in whatever the fast path
// (safetensors_header_simdjson.cc, safetensors_header_fast.h) declines.
#include "loaders/safetensors_header.h"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <functional>
#include <nlohmann/json.hpp>
#include <unordered_set>

#include "allocators/error.h"
#include "loaders/safetensors_header_fast.h"

namespace shardcast {

size_t FindInvalidUtf8(std::string_view s) {
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  size_t i = 0, n = s.size();
  while (i < n) {
    unsigned char c = p[i];
    if (c < 0x80) { ++i; continue; }
    size_t len;
    uint32_t cp;
    if ((c & 0xE0) == 0xC0) { len = 2; cp = c & 0x1F; }
    else if ((c & 0xF0) == 0xE0) { len = 3; cp = c & 0x0F; }
    else if ((c & 0xF8) == 0xF0) { len = 4; cp = c & 0x07; }
    else return i;
    if (i + len > n) return i;
    for (size_t k = 1; k < len; ++k) {
      if ((p[i + k] & 0xC0) != 0x80) return i;
      cp = (cp << 6) | (p[i + k] & 0x3F);
    }
    static constexpr uint32_t kMin[5] = {0, 0, 0x80, 0x800, 0x10000};
    if (cp < kMin[len] || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return i;
    i += len;
  }
  return std::string_view::npos;
}

namespace {

[[noreturn]] void Fail(std::string_view file, const std::string& what) {
  throw Error(ErrorKind::kCheckpoint, std::string(file), what);
}

std::string Quote(std::string_view key) {
  std::string out = "tensor '";
  for (char c : key.substr(0, 200)) out += (c >= 0x20 && c < 0x7f) ? c : '?';
  if (key.size() > 200) out += "...";
  return out + "'";
}

// ---- the diagnosing path ------------------------------------------------------------------------
// Builds the tensor table straight from SAX events: no DOM, duplicates seen as they arrive.
//
//   { "__metadata__": {"k": "v", ...},                       depth 1: tensor keys
//     "<key>": {"dtype": "BF16", "shape": [r, c],            depth 2: tensor fields
//               "data_offsets": [begin, end]}, ... }         depth 3: shape / offsets
class HeaderSax : public nlohmann::json_sax<nlohmann::json> {
 public:
  explicit HeaderSax(std::string_view file, Header* out) : file_(file), out_(out) {}
  std::string error;

  bool null() override {
    if (skipping_) return SkipScalar();
    if (state_ == kMetadataValue) { state_ = kTop; return true; }  // "__metadata__": null
    return Bad("unexpected null");
  }
  bool boolean(bool) override { return skipping_ ? SkipScalar() : Bad("unexpected boolean"); }
  bool number_integer(number_integer_t v) override {
    if (skipping_) return SkipScalar();
    if (v >= 0) return number_unsigned(static_cast<number_unsigned_t>(v));
    return Bad(InArray() + " holds a negative number " + std::to_string(v));
  }
  bool number_unsigned(number_unsigned_t v) override {
    if (skipping_) return SkipScalar();
    if (state_ == kShape) { cur_.shape.push_back(v); return true; }
    if (state_ == kOffsets) {
      if (n_offsets_ >= 2) return Bad("data_offsets must hold exactly 2 numbers");
      (n_offsets_ == 0 ? cur_.begin : cur_.end) = v;
      ++n_offsets_;
      return true;
    }
    return Bad("unexpected number");
  }
  bool number_float(number_float_t, const string_t& text) override {
    if (skipping_) return SkipScalar();
    return Bad(InArray() + " holds " + text + ", which is not a non-negative 64-bit integer");
  }
  bool string(string_t& s) override {
    if (skipping_) return SkipScalar();
    if (state_ == kMetadataMap) {
      out_->metadata.emplace_back(std::move(meta_key_), std::move(s));
      return true;
    }
    if (state_ == kDType) {
      auto d = ParseDType(s);
      if (!d) return Bad("unknown dtype \"" + s.substr(0, 40) + "\"");
      cur_.dtype = *d;
      state_ = kTensor;
      return true;
    }
    return Bad("unexpected string");
  }
  bool binary(binary_t&) override { return skipping_ ? SkipScalar() : Bad("unexpected binary value"); }

  bool start_object(std::size_t) override {
    if (skipping_) return SkipEnter();
    switch (state_) {
      case kStart: state_ = kTop; return true;
      case kMetadataValue: state_ = kMetadataMap; return true;
      case kTensorValue:
        state_ = kTensor;
        seen_fields_ = 0;
        return true;
      default: return Bad("unexpected object");
    }
  }
  bool key(string_t& k) override {
    if (skipping_) return true;
    if (state_ == kTop) {
      if (!top_keys_.insert(k).second) return Bad("duplicate key '" + k.substr(0, 200) + "'");
      if (k == "__metadata__") { state_ = kMetadataValue; return true; }
      cur_ = TensorInfo{};
      cur_.key = std::move(k);
      state_ = kTensorValue;
      return true;
    }
    if (state_ == kMetadataMap) {
      if (!meta_keys_.insert(k).second) return Bad("duplicate __metadata__ key '" + k.substr(0, 200) + "'");
      meta_key_ = std::move(k);
      return true;
    }
    if (state_ == kTensor) {
      int bit = k == "dtype" ? 1 : k == "shape" ? 2 : k == "data_offsets" ? 4 : 0;
      if (bit == 0) {  // unknown fields are ignored, as the reference does
        skipping_ = true;
        return true;
      }
      if (seen_fields_ & bit) return Bad("duplicate field \"" + k + "\"");
      seen_fields_ |= bit;
      state_ = bit == 1 ? kDType : bit == 2 ? kShapeValue : kOffsetsValue;
      return true;
    }
    return Bad("unexpected key");
  }
  bool end_object() override {
    if (skipping_) return SkipLeave();
    switch (state_) {
      case kMetadataMap: state_ = kTop; return true;
      case kTensor:
        if (seen_fields_ != 7) {
          return Bad(std::string("missing field \"") +
                     (!(seen_fields_ & 1) ? "dtype" : !(seen_fields_ & 2) ? "shape" : "data_offsets") + "\"");
        }
        out_->tensors.push_back(std::move(cur_));
        state_ = kTop;
        return true;
      case kTop: state_ = kDone; return true;
      default: return Bad("unexpected end of object");
    }
  }
  bool start_array(std::size_t) override {
    if (skipping_) return SkipEnter();
    if (state_ == kShapeValue) { state_ = kShape; return true; }
    if (state_ == kOffsetsValue) { state_ = kOffsets; n_offsets_ = 0; return true; }
    return Bad("unexpected array");
  }
  bool end_array() override {
    if (skipping_) return SkipLeave();
    if (state_ == kShape) { state_ = kTensor; return true; }
    if (state_ == kOffsets) {
      if (n_offsets_ != 2) return Bad("data_offsets must hold exactly 2 numbers");
      state_ = kTensor;
      return true;
    }
    return Bad("unexpected end of array");
  }
  bool parse_error(std::size_t position, const std::string&, const nlohmann::detail::exception& ex) override {
    error = "header is not valid JSON at byte " + std::to_string(position) + ": " + ex.what();
    return false;
  }

 private:
  enum State {
    kStart, kTop, kMetadataValue, kMetadataMap, kTensorValue, kTensor,
    kDType, kShapeValue, kShape, kOffsetsValue, kOffsets, kDone,
  };

  bool Bad(const std::string& what) {
    if (error.empty()) {
      error = state_ == kTop || state_ == kStart ? "header: " + what
              : (state_ == kMetadataValue || state_ == kMetadataMap)
                  ? "__metadata__ must be a string-to-string map: " + what
                  : Quote(cur_.key) + ": " + what;
    }
    return false;
  }
  std::string InArray() const {
    return state_ == kShape ? "shape" : state_ == kOffsets ? "data_offsets" : "value";
  }
  // Skipping the value of an unknown tensor field: a scalar at depth 0 ends it; containers nest.
  bool SkipScalar() {
    if (skip_depth_ == 0) skipping_ = false;
    return true;
  }
  bool SkipEnter() {
    ++skip_depth_;
    return true;
  }
  bool SkipLeave() {
    if (--skip_depth_ == 0) skipping_ = false;
    return true;
  }

  std::string_view file_;
  Header* out_;
  State state_ = kStart;
  TensorInfo cur_;
  int seen_fields_ = 0;
  int n_offsets_ = 0;
  bool skipping_ = false;
  int skip_depth_ = 0;
  std::string meta_key_;
  std::unordered_set<std::string> top_keys_, meta_keys_;
};

// The offset of the first control character in a key (C0 and DEL, and C1, U+0080-U+009F, as UTF-8's
// 0xC2 0x80-0x9F; the key is valid UTF-8 already), or npos.
size_t FindControl(std::string_view key) {
  for (size_t i = 0; i < key.size(); ++i) {
    const auto c = static_cast<unsigned char>(key[i]);
    if (c < 0x20 || c == 0x7f) return i;
    if (c == 0xc2 && i + 1 < key.size() && static_cast<unsigned char>(key[i + 1]) <= 0x9f) return i;
  }
  return std::string_view::npos;
}

void CheckTensor(std::string_view file, const TensorInfo& t) {
  if (const size_t at = FindControl(t.key); at != std::string_view::npos) {
    char byte[8];
    std::snprintf(byte, sizeof(byte), "0x%02x", static_cast<unsigned char>(t.key[at]));
    Fail(file, Quote(t.key) + " (shown with '?' for each byte not printable ASCII): a tensor key holds a control "
               "character (byte " + std::string(byte) + " at offset " + std::to_string(at) + " of the key)");
  }
  if (t.begin > t.end) {
    Fail(file, Quote(t.key) + ": data_offsets " + ByteRangeText(t.begin, t.end) + " end before they begin");
  }
  uint64_t bytes = DTypeSize(t.dtype);
  for (uint64_t d : t.shape) {
    if (__builtin_mul_overflow(bytes, d, &bytes)) {
      Fail(file, Quote(t.key) + ": shape product times element size overflows 64 bits " +
                     "(data_offsets " + ByteRangeText(t.begin, t.end) + ")");
    }
  }
  if (bytes != t.end - t.begin) {
    std::string shape;
    for (size_t i = 0; i < t.shape.size(); ++i) shape += (i ? ", " : "") + std::to_string(t.shape[i]);
    Fail(file, Quote(t.key) + ": " + std::string(DTypeName(t.dtype)) + " [" + shape + "] needs " +
                   std::to_string(bytes) + " bytes but data_offsets " + ByteRangeText(t.begin, t.end) +
                   " hold " + std::to_string(t.end - t.begin));
  }
}

// Sorted by offset, the tensors must tile [0, data_bytes) exactly.
void CheckCoverage(std::string_view file, const Header& h) {
  std::vector<const TensorInfo*> order;
  order.reserve(h.tensors.size());
  for (const auto& t : h.tensors) order.push_back(&t);
  std::sort(order.begin(), order.end(), [](const TensorInfo* a, const TensorInfo* b) {
    return a->begin != b->begin ? a->begin < b->begin : a->end < b->end;
  });
  uint64_t expected = 0;
  const TensorInfo* prev = nullptr;
  for (const TensorInfo* t : order) {
    if (t->begin != expected) {
      std::string where = prev ? " after " + Quote(prev->key) + " " + ByteRangeText(prev->begin, prev->end)
                               : " at the start of the data area";
      Fail(file, Quote(t->key) + " " + ByteRangeText(t->begin, t->end) +
                     (t->begin > expected ? " leaves a gap" : " overlaps") + where);
    }
    expected = t->end;
    prev = t;
  }
  if (expected != h.data_bytes) {
    Fail(file, "tensors cover data " + ByteRangeText(0, expected) + " but the data area is " +
                   ByteRangeText(0, h.data_bytes) +
                   (expected < h.data_bytes ? " (trailing bytes after the last tensor)"
                                            : " (the file is truncated)"));
  }
}

}  // namespace

uint64_t TensorInfo::numel() const {
  uint64_t n = 1;
  for (uint64_t d : shape) n *= d;  // validated not to overflow by ParseHeader
  return n;
}

uint64_t TensorInfo::row_bytes() const {
  if (shape.empty()) return nbytes();
  uint64_t b = DTypeSize(dtype);
  for (size_t i = 1; i < shape.size(); ++i) b *= shape[i];
  return b;
}

const TensorInfo* Header::Find(std::string_view key) const {
  const size_t i = index.Find(key, [&](size_t j) -> std::string_view { return tensors[j].key; });
  return i == KeyIndex::npos ? nullptr : &tensors[i];
}

bool Header::BuildIndex() {
  return index.Build(tensors.size(), [&](size_t j) -> std::string_view { return tensors[j].key; });
}

std::string ByteRangeText(uint64_t begin, uint64_t end) {
  return "bytes [" + std::to_string(begin) + ", " + std::to_string(end) + ")";
}

uint64_t ParseHeaderLength(std::string_view file, const unsigned char* prefix, uint64_t file_size) {
  if (file_size < 8) {
    Fail(file, "file is " + std::to_string(file_size) + " bytes, too small for the 8-byte header length");
  }
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | prefix[i];
  if (n > kMaxHeaderBytes) {
    Fail(file, "header length " + std::to_string(n) + " (" + ByteRangeText(8, 8 + std::min(n, file_size)) +
                   ") exceeds the limit of " + std::to_string(kMaxHeaderBytes) + " bytes");
  }
  if (8 + n > file_size) {
    Fail(file, "header length " + std::to_string(n) + " claims " + ByteRangeText(8, 8 + n) +
                   " but the file has only " + std::to_string(file_size) + " bytes");
  }
  return n;
}

namespace {

enum class Parsers { kFastFirst, kDiagnosingOnly };

// Everything ParseHeader checks, with the fast parser first or the diagnosing one alone.
Header ParseWith(std::string_view file, std::string_view json, uint64_t file_size, Parsers parsers) {
  const bool fast = parsers == Parsers::kFastFirst;
  Header h;
  h.header_bytes = json.size();
  h.data_bytes = file_size - 8 - json.size();
  if (json.empty() || json[0] != '{') {
    Fail(file, "header " + ByteRangeText(8, 8 + json.size()) + " does not start with '{'");
  }
  if (fast ? !IsValidUtf8Fast(json) : FindInvalidUtf8(json) != std::string_view::npos) {
    const size_t bad = FindInvalidUtf8(json);
    Fail(file, "header is not valid UTF-8" + (bad == std::string_view::npos ? "" : " at byte " + std::to_string(8 + bad)));
  }
  // nlohmann's lexer takes a NUL byte for end of input; raw NUL is never valid JSON, even in strings.
  if (size_t nul = json.find('\0'); nul != std::string_view::npos) {
    Fail(file, "header is not valid JSON: NUL byte at byte " + std::to_string(8 + nul));
  }
  const bool parsed = fast && ParseHeaderFast(json, &h);
  if (fast) ReleaseFastParserAfter(json.size());
  if (!parsed) {
    h.tensors.clear();
    h.metadata.clear();
    HeaderSax sax(file, &h);
    bool ok = nlohmann::json::sax_parse(json.begin(), json.end(), &sax, nlohmann::json::input_format_t::json, true);
    if (!ok) Fail(file, sax.error.empty() ? "header is not valid JSON" : sax.error);
    if (!h.BuildIndex()) Fail(file, "header: a duplicate key the parser did not see");  // HeaderSax rejects them
  }
  for (const TensorInfo& t : h.tensors) CheckTensor(file, t);
  CheckCoverage(file, h);
  return h;
}

}  // namespace

Header ParseHeader(std::string_view file, std::string_view json, uint64_t file_size) {
  return ParseWith(file, json, file_size, Parsers::kFastFirst);
}

Header ParseHeaderDiagnosing(std::string_view file, std::string_view json, uint64_t file_size) {
  return ParseWith(file, json, file_size, Parsers::kDiagnosingOnly);
}

Header ParseFileImage(std::string_view file, const unsigned char* data, size_t size) {
  uint64_t n = ParseHeaderLength(file, data, size);
  return ParseHeader(file, std::string_view(reinterpret_cast<const char*>(data) + 8, n), size);
}

}  // namespace shardcast
