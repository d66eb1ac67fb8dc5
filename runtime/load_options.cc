#include "runtime/load_options.h"

#include <cstdlib>

#include "allocators/error.h"

namespace shardcast {
namespace {

bool ReadUint(const char* name, uint64_t* out) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return false;
  char* end = nullptr;
  unsigned long long x = std::strtoull(v, &end, 10);
  uint64_t mult = 1;
  if (*end == 'K' || *end == 'k') mult = 1ull << 10, ++end;
  else if (*end == 'M' || *end == 'm') mult = 1ull << 20, ++end;
  else if (*end == 'G' || *end == 'g') mult = 1ull << 30, ++end;
  if (*end != '\0' || v[0] == '-') {
    throw Error(ErrorKind::kInvalidArgument, name, std::string("\"") + v + "\" is not a non-negative integer (K/M/G allowed)");
  }
  *out = x * mult;
  return true;
}

}  // namespace

const char* SourceName(Source source) { return source == Source::kRank0 ? "rank0" : "each-rank"; }

void ApplyEnvironment(LoadOptions* o) {
  uint64_t v;
  if (ReadUint("SHARDCAST_CHUNK_BYTES", &v)) o->chunk_bytes = v;
  if (ReadUint("SHARDCAST_STAGING_SLOTS", &v)) o->staging_slots = static_cast<int>(v);
  if (ReadUint("SHARDCAST_TIMEOUT_MS", &v)) o->timeout = std::chrono::milliseconds(v);
  if (ReadUint("SHARDCAST_PREAD", &v)) o->pread = v != 0;
  Validate(*o);
}

void Validate(const LoadOptions& o) {
  if (o.chunk_bytes < 4096) throw Error(ErrorKind::kInvalidArgument, "chunk bytes", "must be at least 4096");
  if (o.staging_slots < 2) throw Error(ErrorKind::kInvalidArgument, "staging slots", "must be at least 2 (read overlaps send)");
}

}  // namespace shardcast
