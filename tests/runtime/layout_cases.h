// tests/runtime/layout_cases: the layouts the multi-process tests load into, by name (TEST_LAYOUT), the
// way torchtitan's and transformers' plans lay out a model:
//
//   tp-fsdp   mesh (W/2, 2) = (dp, tp): matrices alternate Colwise (_StridedShard(0, sf=2), Shard(0)) and
//             Rowwise (Shard(0), Shard(1)); vectors (Shard(0), Replicate())
//   hsdp-tp-fsdp  mesh (2, W/4, 2) = (replica, dp, tp): tp-fsdp's placements after a leading Replicate()
//   shard1    every matrix Shard(1) on the 1-d mesh: one run per row
//   ep        3-d entries (experts) Shard(0) on a mesh of their own, ranks in reverse order; the rest Shard(1)
//             on the 1-d mesh of all ranks
#pragma once

#include <string>

#include "allocators/error.h"
#include "loaders/model_spec.h"
#include "runtime/layout/plan.h"

namespace shardcast {

inline void ApplyTestLayout(const std::string& name, int world, const ModelSpec& spec, PlanOptions* o) {
  auto shard = [](int dim) { return Placement{Placement::kShard, dim, 1}; };
  auto all = [&](bool reverse) {
    std::vector<int> r;
    for (int i = 0; i < world; ++i) r.push_back(reverse ? world - 1 - i : i);
    return r;
  };
  const uint32_t w = static_cast<uint32_t>(world);
  if (name == "tp-fsdp" || name == "hsdp-tp-fsdp") {
    const bool hsdp = name == "hsdp-tp-fsdp";
    if (world % (hsdp ? 4 : 2) != 0) throw Error(ErrorKind::kInvalidArgument, "TEST_LAYOUT", name + ": world size");
    const std::vector<uint32_t> mesh = hsdp ? std::vector<uint32_t>{2, w / 4, 2} : std::vector<uint32_t>{w / 2, 2};
    auto on = [&](std::vector<Placement> p) {
      if (hsdp) p.insert(p.begin(), Placement{});
      return Layout{mesh, all(false), p, {}};
    };
    o->layouts = {on({Placement{Placement::kStridedShard, 0, 2}, shard(0)}), on({shard(0), shard(1)}),
                  on({shard(0), Placement{}})};
    int n = 0;
    for (const SpecEntry& e : spec.entries) {
      if (e.role != Role::kParameter || e.shape.empty()) continue;
      o->layout_of[e.key] = e.shape.size() >= 2 ? static_cast<uint32_t>(n++ % 2) : 2;
    }
  } else if (name == "shard1" || name == "ep") {
    o->layouts = {Layout{{w}, all(false), {shard(1)}, {}}, Layout{{w}, all(true), {shard(0)}, {}}};
    for (const SpecEntry& e : spec.entries) {
      if (e.role != Role::kParameter || e.shape.size() < 2) continue;
      o->layout_of[e.key] = name == "ep" && e.shape.size() == 3 ? 1 : 0;
    }
  } else {
    throw Error(ErrorKind::kInvalidArgument, "TEST_LAYOUT", "no layout named '" + name + "'");
  }
}

}  // namespace shardcast
