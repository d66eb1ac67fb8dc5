#include "runtime/load_options.h"

#include <cstdlib>

#include "allocators/error.h"
#include "allocators/units.h"
#include "runtime/fault.h"

namespace shardcast {
namespace {

constexpr Option kAll[] = {Option::kSource,    Option::kTarget,  Option::kChunkBytes,
                           Option::kStagingSlots, Option::kReadaheadBytes, Option::kTimeoutMs,
                           Option::kVerify,    Option::kStrictKeys, Option::kPread};

[[noreturn]] void Bad(const std::string& origin, const std::string& text, const std::string& why) {
  throw Error(ErrorKind::kInvalidArgument, origin, "\"" + text + "\" " + why);
}

}  // namespace

const char* SourceName(Source source) {
  switch (source) {
    case Source::kAuto: return "auto";
    case Source::kRank0: return "rank0";
    case Source::kEachRank: return "each-rank";
    case Source::kNodeLeader: return "node-leader";
    case Source::kStriped: return "striped";
  }
  return "?";
}

const char* LoadOptionsBuilder::EnvironmentName(Option option) {
  switch (option) {
    case Option::kSource: return "SHARDCAST_SOURCE";
    case Option::kTarget: return "SHARDCAST_TARGET";
    case Option::kChunkBytes: return "SHARDCAST_CHUNK_BYTES";
    case Option::kStagingSlots: return "SHARDCAST_STAGING_SLOTS";
    case Option::kReadaheadBytes: return "SHARDCAST_READAHEAD_BYTES";
    case Option::kTimeoutMs: return "SHARDCAST_TIMEOUT_MS";
    case Option::kVerify: return "SHARDCAST_VERIFY";
    case Option::kStrictKeys: return "SHARDCAST_STRICT_KEYS";
    case Option::kPread: return "SHARDCAST_PREAD";
  }
  return "?";
}

LoadOptionsBuilder& LoadOptionsBuilder::FromEnvironment() {
  for (Option o : kAll) {
    const char* name = EnvironmentName(o);
    const char* v = std::getenv(name);
    if (v == nullptr || *v == '\0') continue;
    auto it = values_.find(o);
    if (it != values_.end() && it->second.explicit_) continue;
    values_[o] = Value{v, name, false};
  }
  return *this;
}

LoadOptionsBuilder& LoadOptionsBuilder::Set(Option option, std::string value, std::string origin) {
  values_[option] = Value{std::move(value), std::move(origin), true};
  return *this;
}

LoadOptions LoadOptionsBuilder::Build() const {
  CheckFaultEnvironment();  // a malformed SHARDCAST_FAULT in a test is a bad option like any other
  LoadOptions o;
  for (const auto& [option, v] : values_) {
    const std::string& t = v.text;
    switch (option) {
      case Option::kSource:
        if (t == "auto") o.source = Source::kAuto;
        else if (t == "rank0") o.source = Source::kRank0;
        else if (t == "each-rank") o.source = Source::kEachRank;
        else if (t == "node-leader") o.source = Source::kNodeLeader;
        else if (t == "striped") o.source = Source::kStriped;
        else Bad(v.origin, t, "is not a source (auto, rank0, each-rank, node-leader or striped)");
        break;
      case Option::kTarget: {
        auto target = ParseTarget(t);
        if (!target) Bad(v.origin, t, "is not a target (cpu, pinned or cuda)");
        o.target = *target;
        break;
      }
      case Option::kChunkBytes:
        o.chunk_bytes = ParseBytes(t, v.origin, kMaxChunkBytes);
        if (o.chunk_bytes < kMinChunkBytes) Bad(v.origin, t, "is below the minimum chunk of 4096 bytes");
        break;
      case Option::kStagingSlots:
        o.staging_slots = static_cast<int>(ParseCount(t, v.origin, kMaxStagingSlots));
        if (o.staging_slots < kMinStagingSlots) Bad(v.origin, t, "is below 2 staging slots (reading overlaps sending)");
        break;
      case Option::kReadaheadBytes: o.readahead_bytes = ParseBytes(t, v.origin, kMaxReadaheadBytes); break;
      case Option::kTimeoutMs:
        o.timeout = std::chrono::milliseconds(ParseCount(t, v.origin, kMaxTimeoutMs));
        if (o.timeout.count() == 0) Bad(v.origin, t, "is not a timeout: it must be at least 1 ms");
        break;
      case Option::kVerify: o.verify = ParseFlag(t, v.origin); break;
      case Option::kStrictKeys: o.strict_keys = ParseFlag(t, v.origin); break;
      case Option::kPread: o.pread = ParseFlag(t, v.origin); break;
    }
  }
  return o;
}

uint64_t ReadaheadFor(const LoadOptions& options, Source source) {
  if (options.readahead_bytes) return *options.readahead_bytes;
  return source == Source::kRank0 || source == Source::kNodeLeader ? 256ull << 20 : 0;
}

LoadOptions LoadOptionsFromEnvironment() { return LoadOptionsBuilder().FromEnvironment().Build(); }

}  // namespace shardcast
