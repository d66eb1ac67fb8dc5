// allocators/units: the one parser of sizes and counts that every option goes through (CLI flags,
// Python keywords, SHARDCAST_* environment variables), so "64MiB" means the same thing everywhere.
//
// Sizes: a decimal number with an optional fraction and an optional unit. K/M/G/T and KiB/MiB/GiB/TiB
// are binary (1024-based), KB/MB/GB/TB decimal, B or nothing is bytes. No sign, no exponent, no
// nan/inf, no spaces. Counts: plain decimal integers, no sign.
//
// Thread safety: pure. Failure: kInvalidArgument whose context is `origin` (the flag, keyword or
// variable the text came from) and whose cause quotes the text and says what is accepted.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

namespace shardcast {

// REQUIRES: nothing. Returns bytes; throws when the text is malformed or the value exceeds `max`.
uint64_t ParseBytes(std::string_view text, std::string_view origin = "", uint64_t max = UINT64_MAX / 2);
// A non-negative integer no larger than `max`.
uint64_t ParseCount(std::string_view text, std::string_view origin = "", uint64_t max = UINT64_MAX / 2);
// "1", "true", "yes", "on" / "0", "false", "no", "off" (any case).
bool ParseFlag(std::string_view text, std::string_view origin = "");

}  // namespace shardcast
