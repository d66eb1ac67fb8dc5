// runtime/layout/plan: the entries of a model and how each is laid out over the ranks (runtime/layout/layout.h).
//
// Every entry has a Layout: its DTensor's mesh and placements. By default a sharded entry gets FSDP2's
// dim-0 layout over the whole world (or HSDP's (Replicate(), Shard(0)) on (R, W / R)), and 0-dim
// entries, buffers and entries the spec declares replicated are Replicate on every rank. A caller with
// real DTensors (the Python binding) gives each entry its own layout: TP, EP, 2-D and 3-D meshes,
// _StridedShard, different meshes for different entries. Shard(0) is one layout among these:
//
//   entry [n rows]   rank 0      rank 1      ...   rank W-1
//   Shard(0)         [0, c)      [c, 2c)           [min((W-1)c, n), n)     c = ceil(n / W)
//   Replicate        [0, n)      [0, n)            [0, n)
//
// The global shape is always kept explicitly, never derived as local x world.
//
// Thread safety: immutable after Build. Failure: kInvalidArgument (world size, rank, a layout that does
// not fit its entry, naming the key).
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "loaders/key_index.h"
#include "loaders/model_spec.h"
#include "runtime/layout/layout.h"

namespace shardcast {

struct RowRange {
  uint64_t begin = 0, end = 0;
  uint64_t rows() const { return end - begin; }
  bool empty() const { return begin == end; }
};

// FSDP2's dim-0 rule for n rows over `world` ranks (torch.chunk's). REQUIRES: 0 <= rank < world.
RowRange ShardRows(uint64_t n, int world, int rank);

// Refers into the ModelSpec its Plan owns: a plan of 100k entries adds no copy of keys or shapes.
struct PlanEntry {
  explicit PlanEntry(const SpecEntry& e)
      : key(e.key), shape(e.shape), dtype(e.dtype), role(e.role), init_rule(e.init_rule) {}

  const std::string& key;
  const std::vector<uint64_t>& shape;  // global
  DType dtype;
  Role role;
  const std::string_view& init_rule;  // non-persistent buffers (the spec entry's view: 8 B here, not 16)
  const Layout* layout = nullptr;  // into the plan's layout table
  uint32_t layout_index = 0;

  uint64_t numel() const;
  uint64_t nbytes() const { return numel() * DTypeSize(dtype); }
  bool replicated() const { return layout->replicated(); }
  Piece PieceOf(int rank) const { return shardcast::PieceOf(shape, *layout, rank); }
  std::vector<uint64_t> LocalShape(int rank) const { return PieceOf(rank).LocalShape(); }
};

struct PlanOptions {
  int replicas = 1;  // default 1 (FSDP2). R > 1: HSDP's (Replicate(), Shard(0)) on (R, W / R)
  // Per-entry layouts (default: none, every entry gets the default above): layouts[layout_of[key]].
  std::vector<Layout> layouts;
  std::map<std::string, uint32_t> layout_of;
};

class Plan {
 public:
  Plan() = default;
  Plan(Plan&&) = default;  // move-only: entries_ refer into spec_
  Plan& operator=(Plan&&) = default;
  Plan(const Plan&) = delete;
  Plan& operator=(const Plan&) = delete;

  // Takes the spec (move it in where the caller is done with it); entries refer into it. world_size:
  // every rank of the communicator.
  static Plan Build(ModelSpec spec, int world_size, const PlanOptions& options = {});

  const ModelSpec& spec() const { return spec_; }
  int world_size() const { return world_size_; }
  const std::vector<PlanEntry>& entries() const { return entries_; }
  const std::vector<Layout>& layouts() const { return layouts_; }
  const PlanEntry* Find(std::string_view key) const;
  // Find for keys asked in plan order (a manifest's entries, 90k at DeepSeek-V3's scale): the entries
  // just after the previous answer are compared first, so no key is hashed while the order holds.
  // `cursor` starts at 0 and is the caller's.
  const PlanEntry* FindNext(std::string_view key, size_t* cursor) const;

  struct RankBytes {
    uint64_t by_role[4] = {0, 0, 0, 0};  // indexed by Role
    uint64_t total() const { return by_role[0] + by_role[1] + by_role[2] + by_role[3]; }
  };
  RankBytes LocalBytes(int rank) const;
  std::vector<const PlanEntry*> EntriesWithoutRows(int rank) const;  // sharded entries this rank holds nothing of
  void CheckRank(int rank) const;  // throws kInvalidArgument naming rank and world size

 private:
  int world_size_ = 1;
  ModelSpec spec_;
  std::vector<Layout> layouts_;  // [0] replicated, [1] the default sharded layout, then the caller's
  std::vector<PlanEntry> entries_;
  KeyIndex index_;  // key -> position in entries_ (the spec's keys; a duplicate key finds its first entry)
};

}  // namespace shardcast
