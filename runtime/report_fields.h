// runtime/report_fields: the per-rank rows of load's and save's reports, gathered and written from one
// table each. A row's fields travel in one AllGather (runtime/agree/verdict.h: int64 words, seconds as
// microseconds) and are written to the report's JSON under their names, both by walking the same table:
// a field is added in one place, and the packing cannot fall out of step with the unpacking.
//
//   constexpr ReportField<RankReport> kFields[] = {{"seconds", &RankReport::seconds}, ...};
//   report.ranks = GatherRows(comm, mine, kFields);     // every rank's row, rank order
//   json["ranks"].push_back(RowJson(row, kFields));     // {"rank": r, "seconds": ..., ...}
//
// Thread safety: GatherRows is a collective (every rank of comm calls it together).
#pragma once

#include <cstddef>
#include <cstdint>
#include <nlohmann/json.hpp>
#include <variant>
#include <vector>

#include "runtime/agree/communicator.h"
#include "runtime/agree/verdict.h"

namespace shardcast {

template <typename Row>
struct ReportField {
  const char* json;  // the name in the report's JSON; nullptr: gathered, written by the report itself
  std::variant<uint64_t Row::*, double Row::*, int Row::*> member;
};

namespace report_fields {

template <typename Row>
int64_t Pack(const Row& row, const ReportField<Row>& f) {
  if (auto m = std::get_if<double Row::*>(&f.member)) return static_cast<int64_t>(row.**m * 1e6);
  if (auto m = std::get_if<uint64_t Row::*>(&f.member)) return static_cast<int64_t>(row.**m);
  return static_cast<int64_t>(row.*std::get<int Row::*>(f.member));
}

template <typename Row>
void Unpack(int64_t word, const ReportField<Row>& f, Row* row) {
  if (auto m = std::get_if<double Row::*>(&f.member)) row->**m = static_cast<double>(word) / 1e6;
  else if (auto m = std::get_if<uint64_t Row::*>(&f.member)) row->**m = static_cast<uint64_t>(word);
  else row->*std::get<int Row::*>(f.member) = static_cast<int>(word);
}

}  // namespace report_fields

// Every rank's row, in rank order, each with its `rank` set.
template <typename Row, size_t N>
std::vector<Row> GatherRows(Communicator& comm, const Row& mine, const ReportField<Row> (&fields)[N]) {
  std::vector<int64_t> words;
  words.reserve(N);
  for (const auto& f : fields) words.push_back(report_fields::Pack(mine, f));
  const auto all = AllGather(comm, words);
  std::vector<Row> out(all.size());
  for (size_t r = 0; r < all.size(); ++r) {
    out[r].rank = static_cast<int>(r);
    for (size_t i = 0; i < N; ++i) report_fields::Unpack(all[r][i], fields[i], &out[r]);
  }
  return out;
}

// {"rank": r, then each named field in table order}.
template <typename Row, size_t N>
nlohmann::ordered_json RowJson(const Row& row, const ReportField<Row> (&fields)[N]) {
  nlohmann::ordered_json j;
  j["rank"] = row.rank;
  for (const auto& f : fields) {
    if (f.json == nullptr) continue;
    std::visit([&](auto m) { j[f.json] = row.*m; }, f.member);
  }
  return j;
}

}  // namespace shardcast
