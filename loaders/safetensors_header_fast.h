// loaders/safetensors_header_fast: the fast path of ParseHeader, for safetensors_header.cc alone. Not part
// of the loaders' API; nothing outside loaders/ includes it.
//
// simdjson's DOM parser (a validating parser: RFC 8259, UTF-8, no raw control characters; ~1 GB/s here
// against nlohmann's ~75 MB/s) and one walk of its tree that accepts only a header the rules in
// safetensors_header.h accept. It reports nothing: whatever it does not accept (invalid JSON, a duplicate
// key, a float or a number past 64 bits, a missing field, nesting past simdjson's 1024 levels) is parsed
// again by the diagnosing parser (HeaderSax in safetensors_header.cc), which decides and names the
// problem. So it may decline more than it must, never accept more, and it builds the same Header;
// tests/loaders/header_paths_test.cc and the fuzzer check both.
//
// Defined in safetensors_header_simdjson.cc, which is built only where CMake found simdjson
// (SHARDCAST_HAVE_SIMDJSON). Without it the fast path declines every header: ParseHeader is the
// diagnosing parser alone. Thread-safe: each thread keeps a parser of its own (see ReleaseFastParserAfter).
#pragma once

#include <cstddef>
#include <string_view>

#include "loaders/safetensors_header.h"

namespace shardcast {

// The first invalid UTF-8 byte's offset in `s`, or npos. Rejects overlongs and surrogates. The
// diagnosing parser's check; defined in safetensors_header.cc.
size_t FindInvalidUtf8(std::string_view s);

#if SHARDCAST_HAVE_SIMDJSON
// Fills h->tensors, h->metadata and h->index, or returns false (h is then to be thrown away).
// REQUIRES: h->tensors and h->metadata are empty.
bool ParseHeaderFast(std::string_view json, Header* h);

// Whether `s` is valid UTF-8: simdjson's validator (SIMD, the same rules as FindInvalidUtf8: no overlongs,
// no surrogates, nothing past U+10FFFF). FindInvalidUtf8 then finds where, on the error path only.
bool IsValidUtf8Fast(std::string_view s);

// Called after each ParseHeaderFast of a header of `json_bytes`: this thread's parser keeps its buffers
// (a few times the largest header parsed) for headers up to 1 MB and frees them after a larger one.
void ReleaseFastParserAfter(size_t json_bytes);
#else
// Built without simdjson: the slow path only.
inline bool ParseHeaderFast(std::string_view, Header*) { return false; }
inline bool IsValidUtf8Fast(std::string_view s) { return FindInvalidUtf8(s) == std::string_view::npos; }
inline void ReleaseFastParserAfter(size_t) {}
#endif

}  // namespace shardcast
