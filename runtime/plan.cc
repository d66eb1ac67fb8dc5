#include "runtime/plan.h"

#include <algorithm>

#include "allocators/error.h"

namespace shardcast {

RowRange ShardRows(uint64_t n, int world, int rank) {
  const uint64_t w = static_cast<uint64_t>(world), r = static_cast<uint64_t>(rank);
  const uint64_t chunk = (n + w - 1) / w;
  RowRange range;
  range.begin = std::min(n, r * chunk);
  range.end = std::min(n, range.begin + chunk);
  return range;
}

uint64_t PlanEntry::row_bytes() const {
  uint64_t b = DTypeSize(dtype);
  for (size_t i = 1; i < shape.size(); ++i) b *= shape[i];
  return b;
}

RowRange PlanEntry::Local(int world, int rank) const {
  if (placement.kind == Placement::kReplicate) return RowRange{0, rows()};
  return ShardRows(rows(), world, rank);
}

std::vector<uint64_t> PlanEntry::LocalShape(int world, int rank) const {
  std::vector<uint64_t> s = shape;
  if (!s.empty()) s[0] = Local(world, rank).rows();
  return s;
}

Plan Plan::Build(ModelSpec spec, int world_size, const PlanOptions& options) {
  if (world_size < 1) {
    throw Error(ErrorKind::kInvalidArgument, "plan", "world size must be at least 1, got " + std::to_string(world_size));
  }
  Plan plan;
  plan.world_size_ = world_size;
  plan.spec_ = std::move(spec);
  plan.entries_.reserve(plan.spec_.entries.size());
  for (const SpecEntry& e : plan.spec_.entries) {
    PlanEntry p(e);
    const bool buffer = e.role == Role::kPersistentBuffer || e.role == Role::kNonPersistentBuffer;
    if (e.shape.empty() || e.replicated || buffer) {
      p.placement.kind = Placement::kReplicate;
    } else if (auto it = options.shard_dims.find(e.key); it != options.shard_dims.end() && it->second != 0) {
      throw Error(ErrorKind::kUnsupported, e.key,
                  "Shard(" + std::to_string(it->second) + ") is not supported: its rows are not contiguous; "
                  "only Shard(0) and Replicate are");
    }
    plan.entries_.push_back(std::move(p));
  }
  plan.index_.reserve(plan.entries_.size());
  for (size_t i = 0; i < plan.entries_.size(); ++i) plan.index_.emplace(plan.entries_[i].key, i);
  return plan;
}

const PlanEntry* Plan::Find(const std::string& key) const {
  auto it = index_.find(key);
  return it == index_.end() ? nullptr : &entries_[it->second];
}

void Plan::CheckRank(int rank) const {
  if (rank < 0 || rank >= world_size_) {
    throw Error(ErrorKind::kInvalidArgument, "plan",
                "rank " + std::to_string(rank) + " is outside world size " + std::to_string(world_size_));
  }
}

Plan::RankBytes Plan::LocalBytes(int rank) const {
  CheckRank(rank);
  RankBytes b;
  for (const auto& e : entries_) b.by_role[static_cast<int>(e.role)] += e.Local(world_size_, rank).rows() * e.row_bytes();
  return b;
}

std::vector<const PlanEntry*> Plan::EntriesWithoutRows(int rank) const {
  CheckRank(rank);
  std::vector<const PlanEntry*> out;
  for (const auto& e : entries_) {
    if (e.placement.kind == Placement::kShard && e.Local(world_size_, rank).empty()) out.push_back(&e);
  }
  return out;
}

}  // namespace shardcast
