#include "runtime/layout/parallel_plan.h"

#include <string>

#include "allocators/error.h"

namespace shardcast {
namespace {

bool EndsWith(const std::string& s, const std::string& tail) {
  return s.size() >= tail.size() && s.compare(s.size() - tail.size(), tail.size(), tail) == 0;
}

enum Rule : uint32_t { kColumn = 0, kRow = 1, kFsdpOnly = 2 };

Rule RuleFor(const SpecEntry& e) {
  if (e.shape.size() == 3 && e.key.find("experts") != std::string::npos) return kColumn;  // EP along dim 0
  if (e.shape.size() != 2) return kFsdpOnly;
  for (const char* t : {"q_proj.weight", "k_proj.weight", "v_proj.weight", "q_b_proj.weight", "kv_b_proj.weight",
                        "gate_proj.weight", "up_proj.weight", "w1.weight", "w3.weight", "lm_head.weight"}) {
    if (EndsWith(e.key, t)) return kColumn;
  }
  for (const char* t : {"o_proj.weight", "down_proj.weight", "w2.weight"}) {
    if (EndsWith(e.key, t)) return kRow;
  }
  return kFsdpOnly;
}

}  // namespace

PlanOptions ParallelPlan(const ModelSpec& spec, int world, ParallelSizes sizes) {
  if (sizes.replicas < 1 || sizes.tp < 1 || world % (sizes.replicas * sizes.tp) != 0) {
    throw Error(ErrorKind::kInvalidArgument, "parallel plan",
                std::to_string(sizes.replicas) + " replicas x " + std::to_string(sizes.tp) +
                    " tensor-parallel ranks do not divide a world of " + std::to_string(world));
  }
  PlanOptions o;
  o.replicas = sizes.replicas;
  if (sizes.tp == 1) return o;  // FSDP2 or HSDP: the plan's default layout
  const uint32_t t = static_cast<uint32_t>(sizes.tp), d = static_cast<uint32_t>(world / (sizes.replicas * sizes.tp));
  std::vector<uint32_t> mesh{d, t};
  std::vector<Placement> lead;
  if (sizes.replicas > 1) {
    mesh.insert(mesh.begin(), static_cast<uint32_t>(sizes.replicas));
    lead.push_back(Placement{});
  }
  std::vector<int> ranks;
  for (int r = 0; r < world; ++r) ranks.push_back(r);
  auto layout = [&](Placement fsdp, Placement tp) {
    std::vector<Placement> p = lead;
    p.push_back(fsdp);
    p.push_back(tp);
    return Layout{mesh, ranks, p, {}};
  };
  const Placement shard0{Placement::kShard, 0, 1}, shard1{Placement::kShard, 1, 1};
  o.layouts = {layout(Placement{Placement::kStridedShard, 0, t}, shard0), layout(shard0, shard1),
               layout(shard0, Placement{})};
  for (const SpecEntry& e : spec.entries) {
    if (e.role != Role::kParameter || e.shape.empty() || e.replicated) continue;
    o.layout_of[e.key] = RuleFor(e);
  }
  return o;
}

}  // namespace shardcast
