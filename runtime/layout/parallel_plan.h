// runtime/layout/parallel_plan: the layouts a TP x FSDP (x EP) training job gives a model, from its keys alone,
// for callers without DTensors (the command line, benchmarks, forecasts). The rules are the ones
// torchtitan's and transformers' tensor-parallel plans use for decoder models:
//
//   mesh (R x) (D, T) over the world, row-major; D = world / (R x T) ranks of FSDP, T of TP
//   column-parallel linears  (q/k/v/q_b/kv_b/gate/up/lm_head .weight)  TP Shard(0), then FSDP over it:
//                            (_StridedShard(0, sf=T), Shard(0))
//   row-parallel linears     (o_proj, down_proj .weight)               (Shard(0), Shard(1))
//   expert stacks [E, ...]   (3-d, under "experts")                    EP splits the experts over the T ranks,
//                                                                      FSDP each part: (_StridedShard(0, sf=T), Shard(0))
//   everything else          (norms, embeddings, routers, biases)      (Shard(0), Replicate()): FSDP only
// With R > 1 a leading Replicate() dim makes it HSDP. T = 1 is plain FSDP2 (or HSDP).
//
// Thread safety: pure. Failure: kInvalidArgument when R x T does not divide the world.
#pragma once

#include "loaders/model_spec.h"
#include "runtime/layout/plan.h"

namespace shardcast {

struct ParallelSizes {
  int replicas = 1;  // R (HSDP); default 1
  int tp = 1;        // T; default 1
};

// PlanOptions with a layout for every parameter of `spec` over `world_size` ranks.
PlanOptions ParallelPlan(const ModelSpec& spec, int world_size, ParallelSizes sizes);

}  // namespace shardcast
