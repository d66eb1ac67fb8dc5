// runtime/plan: which rows of which entry each rank holds, by FSDP2's rule.
//
// Shard(0) splits dim 0 the way torch.chunk does: chunks of ceil(n / W) rows, so trailing ranks get
// fewer rows or none (n=5, W=4: 2, 2, 1, 0; n=3, W=8: 1, 1, 1 and five empty ranks). 0-dim entries,
// buffers, and entries the spec declares replicated are Replicate: every rank holds all of it. The
// global shape is always kept explicitly, never derived as local x world.
//
//   entry [n rows]   rank 0      rank 1      ...   rank W-1
//   Shard(0)         [0, c)      [c, 2c)           [min((W-1)c, n), n)     c = ceil(n / W)
//   Replicate        [0, n)      [0, n)            [0, n)
//
// Thread safety: immutable after Build. Failure: kInvalidArgument (world size, rank),
// kUnsupported (Shard(d) for d != 0, naming the key).
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "loaders/model_spec.h"

namespace shardcast {

struct Placement {
  enum Kind { kShard, kReplicate } kind = kShard;
  int dim = 0;  // for kShard
};

struct RowRange {
  uint64_t begin = 0, end = 0;
  uint64_t rows() const { return end - begin; }
  bool empty() const { return begin == end; }
};

// FSDP2's dim-0 rule for n rows over `world` ranks. REQUIRES: 0 <= rank < world.
RowRange ShardRows(uint64_t n, int world, int rank);

// Refers into the ModelSpec its Plan owns: a plan of 100k entries adds no copy of keys or shapes.
struct PlanEntry {
  explicit PlanEntry(const SpecEntry& e)
      : key(e.key), shape(e.shape), dtype(e.dtype), role(e.role), init_rule(e.init_rule) {}

  const std::string& key;
  const std::vector<uint64_t>& shape;  // global
  DType dtype;
  Role role;
  Placement placement;
  const std::string& init_rule;  // non-persistent buffers

  uint64_t rows() const { return shape.empty() ? 1 : shape[0]; }
  uint64_t row_bytes() const;          // bytes of one dim-0 row (all of a 0-dim entry)
  uint64_t nbytes() const { return rows() * row_bytes(); }
  RowRange Local(int world, int rank) const;
  std::vector<uint64_t> LocalShape(int world, int rank) const;
};

struct PlanOptions {
  // key -> shard dim, for entries a model shards on a dim other than 0 (default: none). Non-zero dims
  // are not supported yet and are rejected by name.
  std::map<std::string, int> shard_dims;
};

class Plan {
 public:
  Plan() = default;
  Plan(Plan&&) = default;  // move-only: the index points into entries_
  Plan& operator=(Plan&&) = default;
  Plan(const Plan&) = delete;
  Plan& operator=(const Plan&) = delete;

  // Takes the spec (move it in where the caller is done with it); entries refer into it.
  static Plan Build(ModelSpec spec, int world_size, const PlanOptions& options = {});

  const ModelSpec& spec() const { return spec_; }
  int world_size() const { return world_size_; }
  const std::vector<PlanEntry>& entries() const { return entries_; }
  const PlanEntry* Find(const std::string& key) const;

  struct RankBytes {
    uint64_t by_role[4] = {0, 0, 0, 0};  // indexed by Role
    uint64_t total() const { return by_role[0] + by_role[1] + by_role[2] + by_role[3]; }
  };
  RankBytes LocalBytes(int rank) const;
  std::vector<const PlanEntry*> EntriesWithoutRows(int rank) const;  // sharded entries this rank holds none of
  void CheckRank(int rank) const;  // throws kInvalidArgument naming rank and world size

 private:
  int world_size_ = 1;
  ModelSpec spec_;
  std::vector<PlanEntry> entries_;
  std::unordered_map<std::string_view, size_t> index_;
};

}  // namespace shardcast
