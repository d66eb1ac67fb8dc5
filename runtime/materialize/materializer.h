// runtime/materialize/materializer: what one rank holds before the weights arrive (the call before fully_shard).
//
//   parameters, sidecars     meta: no storage (and no TensorImpl either: the plan holds their shape)
//                            until AllocateShards(), and then only this rank's rows
//   persistent buffers       real, zero, replicated: filled from the checkpoint by the load
//   non-persistent buffers   real, computed here from the config by the BufferInitRegistry
//
// Storage by target: kCpu lazy-zero (reads as zero, commits only what is written), kPinned
// page-locked host memory, kCuda device memory (zeroed). No byte handed out is garbage: every
// tensor is either computed or explicitly zero.
//
// Thread safety: a RankState is used by one thread. Failure: kConfig (no init rule, bad config),
// kInvalidArgument (rank, world size), kUnsupported (a target this build or machine cannot serve).
#pragma once

#include <ATen/core/Tensor.h>

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "allocators/lazy_zero.h"
#include "runtime/layout/plan.h"
#include "runtime/layout/target.h"

namespace shardcast {

struct PrepareOptions {
  Target target = Target::kCpu;  // default kCpu
  int device_index = 0;          // default 0: the CUDA device for kCuda (usually LOCAL_RANK)
  // default: no huge pages. Measured on the dev VM (THP "madvise", defrag "madvise"): MADV_HUGEPAGE
  // shards made a 2.5 GB each-rank load 2x slower (direct compaction against a page cache full of
  // checkpoint), so it is opt-in.
  LazyZeroOptions host;
};

// Storage for a local tensor on a target: zero (lazy on CPU), never garbage.
at::Tensor AllocateZeroed(at::IntArrayRef sizes, at::ScalarType dtype, Target target, const PrepareOptions& options);

struct LocalTensor {
  const PlanEntry* entry = nullptr;
  std::vector<uint64_t> local_shape;  // this rank's piece (runtime/layout/layout.h), as a local tensor
  at::Tensor tensor;           // undefined until allocated (parameters, sidecars); real for buffers
  // The lazy-zero mapping under `tensor` where AllocateShards made it on the host (allocators/tensor_alloc.h):
  // it keeps the pages mapped for whoever holds it, whatever becomes of the tensor. Null otherwise.
  std::shared_ptr<const void> mapping;
  bool is_meta() const { return !tensor.defined() || tensor.is_meta(); }
  at::Tensor MetaTensor() const;  // a meta tensor of the local shape, for callers that want one
  bool from_checkpoint = false;  // parameters, sidecars, persistent buffers
  std::string note;            // init rule's note for computed buffers
};

struct PrepareReport {
  int rank = 0, world_size = 1;
  Target target = Target::kCpu;
  size_t meta_entries = 0, computed_buffers = 0, persistent_buffers = 0, entries_without_rows = 0;
  uint64_t buffer_bytes = 0;         // real memory held after Prepare
  uint64_t shard_bytes = 0;          // what AllocateShards will add (this rank's rows only)
  std::vector<std::string> notes;    // "model.rotary_emb.inv_freq: yarn, attention scaling 1"
};

class RankState {
 public:
  // REQUIRES: plan outlives the RankState.
  static RankState Prepare(const Plan& plan, int rank, const PrepareOptions& options = {});

  // A state over tensors the caller already holds (FSDP2's local shards, or an explicit mapping), one
  // per plan entry in plan order. Each must be contiguous with the entry's local shape and dtype;
  // anything else is kInvalidArgument naming the key, both shapes and the rank.
  static RankState Adopt(const Plan& plan, int rank, std::vector<at::Tensor> tensors);

  // Gives parameters and sidecars storage for this rank's rows (idempotent).
  void AllocateShards();

  int rank() const { return rank_; }
  const Plan& plan() const { return *plan_; }
  std::vector<LocalTensor>& tensors() { return tensors_; }
  const std::vector<LocalTensor>& tensors() const { return tensors_; }
  LocalTensor* Find(const std::string& key);  // O(1), by the plan's index
  LocalTensor* FindNext(std::string_view key, size_t* cursor);  // keys in plan order (Plan::FindNext)
  const PrepareReport& report() const { return report_; }

 private:
  const Plan* plan_ = nullptr;
  int rank_ = 0;
  PrepareOptions options_;
  std::vector<LocalTensor> tensors_;
  PrepareReport report_;
};

}  // namespace shardcast
