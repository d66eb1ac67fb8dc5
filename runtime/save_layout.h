// runtime/save_layout: what rank 0 decides before a save moves a byte, and what every rank checks.
#pragma once

#include <nlohmann/json.hpp>

#include <string>
#include <vector>

#include "runtime/layout/plan.h"
#include "runtime/manifest/manifest.h"
#include "runtime/save.h"

namespace shardcast {

// What rank 0 decided and every rank agreed on.
struct Agreed {
  Manifest manifest;
  std::string out_dir, tmp_dir;
  std::vector<std::string> headers, leftovers;  // rank 0 only
  std::string index;                            // rank 0 only; "" for a single file
};

// Rank 0's decision: out_dir and a fresh tmp dir beside it (leftovers of earlier saves named), the
// manifest of output tensors, and each file's header and the index. Throws on bad input.
Agreed Decide(const Plan& plan, const SaveRequest& rq, int world);

// What every rank must ask for the same (rank 0's governs the layout; a difference is an error).
nlohmann::json Params(const SaveRequest& rq);

// "" when this rank's request matches rank 0's `theirs`, else what differs, naming both ranks.
std::string CheckParams(const nlohmann::json& theirs, const SaveRequest& rq, int rank);

}  // namespace shardcast
