#include "runtime/layout/target.h"

namespace shardcast {

std::optional<Target> ParseTarget(const std::string& name) {
  if (name == "cpu") return Target::kCpu;
  if (name == "pinned") return Target::kPinned;
  if (name == "cuda") return Target::kCuda;
  return std::nullopt;
}

const char* TargetName(Target target) {
  switch (target) {
    case Target::kCpu: return "cpu";
    case Target::kPinned: return "pinned";
    case Target::kCuda: return "cuda";
  }
  return "?";
}

}  // namespace shardcast
