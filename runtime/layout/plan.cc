#include "runtime/layout/plan.h"

#include <algorithm>
#include <set>

#include "allocators/error.h"

namespace shardcast {

RowRange ShardRows(uint64_t n, int world, int rank) {
  const Span s = ChunkSpan(n, static_cast<uint64_t>(world), static_cast<uint64_t>(rank));
  return RowRange{s.begin, s.end};
}

uint64_t PlanEntry::numel() const {
  uint64_t n = 1;
  for (uint64_t d : shape) n *= d;
  return n;
}

Plan Plan::Build(ModelSpec spec, int world_size, const PlanOptions& options) {
  if (world_size < 1) {
    throw Error(ErrorKind::kInvalidArgument, "plan", "world size must be at least 1, got " + std::to_string(world_size));
  }
  if (options.replicas < 1 || world_size % options.replicas != 0) {
    throw Error(ErrorKind::kInvalidArgument, "mesh",
                std::to_string(options.replicas) + " replicas do not divide a world of " +
                    std::to_string(world_size) + " ranks");
  }
  Plan plan;
  plan.world_size_ = world_size;
  plan.spec_ = std::move(spec);
  plan.layouts_ = {ReplicatedLayout(), DimZeroLayout(world_size, options.replicas)};
  plan.layouts_.insert(plan.layouts_.end(), options.layouts.begin(), options.layouts.end());
  plan.entries_.reserve(plan.spec_.entries.size());
  std::set<std::pair<uint32_t, std::vector<uint64_t>>> checked;  // (layout, shape) pairs checked
  for (const SpecEntry& e : plan.spec_.entries) {
    PlanEntry p(e);
    const bool buffer = e.role == Role::kPersistentBuffer || e.role == Role::kNonPersistentBuffer;
    if (auto it = options.layout_of.find(e.key); it != options.layout_of.end()) {
      if (it->second >= options.layouts.size()) {
        throw Error(ErrorKind::kInternal, e.key, "layout index out of range");
      }
      p.layout_index = 2 + it->second;
      // Once per layout and shape: a check walks the mesh's ranks, thousands at scale, and 90k entries
      // share a few dozen shapes.
      if (checked.emplace(p.layout_index, e.shape).second) {
        const Layout& l = plan.layouts_[p.layout_index];
        l.CheckKey(e.shape, e.key);
        for (int r : l.ranks) {
          if (r >= world_size) {
            throw Error(ErrorKind::kInvalidArgument, "key '" + e.key + "'",
                        l.Text() + " names rank " + std::to_string(r) + " outside a world of " +
                            std::to_string(world_size));
          }
        }
      }
    } else {
      p.layout_index = e.shape.empty() || e.replicated || buffer ? 0 : 1;
    }
    plan.entries_.push_back(std::move(p));
  }
  for (PlanEntry& p : plan.entries_) p.layout = &plan.layouts_[p.layout_index];
  plan.index_.Build(plan.entries_.size(), [&](size_t i) -> std::string_view { return plan.entries_[i].key; });
  return plan;
}

const PlanEntry* Plan::Find(std::string_view key) const {
  const size_t i = index_.Find(key, [&](size_t j) -> std::string_view { return entries_[j].key; });
  return i == KeyIndex::npos ? nullptr : &entries_[i];
}

const PlanEntry* Plan::FindNext(std::string_view key, size_t* cursor) const {
  constexpr size_t kLookAhead = 4;  // past the few entries a manifest leaves out (non-persistent buffers)
  for (size_t j = *cursor; j < entries_.size() && j < *cursor + kLookAhead; ++j) {
    if (entries_[j].key == key) {
      *cursor = j + 1;
      return &entries_[j];
    }
  }
  const PlanEntry* e = Find(key);
  if (e != nullptr) *cursor = static_cast<size_t>(e - entries_.data()) + 1;
  return e;
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
  for (const auto& e : entries_) b.by_role[static_cast<int>(e.role)] += e.PieceOf(rank).numel() * DTypeSize(e.dtype);
  return b;
}

std::vector<const PlanEntry*> Plan::EntriesWithoutRows(int rank) const {
  CheckRank(rank);
  std::vector<const PlanEntry*> out;
  for (const auto& e : entries_) {
    if (!e.replicated() && e.PieceOf(rank).numel() == 0) out.push_back(&e);
  }
  return out;
}

}  // namespace shardcast
