// runtime/layout/target: where a rank's shards live. Its own header so that options, the manifest and the
// planning core name a target without the materializer (and libtorch) behind it.
#pragma once

#include <optional>
#include <string>

namespace shardcast {

enum class Target { kCpu, kPinned, kCuda };
// "cpu", "pinned", "cuda"; nullopt for anything else.
std::optional<Target> ParseTarget(const std::string& name);
const char* TargetName(Target target);

}  // namespace shardcast
