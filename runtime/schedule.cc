#include "runtime/schedule.h"

#include <algorithm>

namespace shardcast {
namespace {

uint64_t Numel(const std::vector<uint64_t>& s) {
  uint64_t n = 1;
  for (uint64_t d : s) n *= d;
  return n;
}

uint64_t Rows(const ManifestEntry& e) { return e.shape.empty() ? 1 : e.shape[0]; }

// Calls fn(part, element offset within the part, count) for the parts that supply elements
// [first, first + n) of an entry, in order.
template <typename F>
void ForEachPart(const ManifestEntry& e, uint64_t first, uint64_t n, F&& fn) {
  uint64_t start = 0;  // the entry element at which the current part begins
  for (uint32_t p = 0; p < e.parts.size() && n > 0; ++p) {
    const uint64_t size = e.parts[p].numel;
    if (first < start + size) {
      const uint64_t within = first - start, k = std::min(n, size - within);
      fn(p, within, k);
      first += k;
      n -= k;
    }
    start += size;
  }
}

Segment MakeSegment(const ManifestEntry& e, uint32_t index, uint32_t part, uint64_t within, uint64_t k,
                    uint64_t local_elem) {
  const ManifestPart& p = e.parts[part];
  const uint64_t ss = DTypeSize(p.source_dtype), ts = DTypeSize(e.target_dtype);
  return Segment{index, part, within, k, p.offset + within * ss, k * ss, local_elem * ts, k * ts};
}

}  // namespace

Schedule::Schedule(const Manifest& m)
    : m_(m), world_(m.world_size), chunk_(m.params.chunk_bytes),
      coalesce_(std::min(m.params.coalesce_bytes, m.params.chunk_bytes)) {}

bool Schedule::Next(Message* out) {
  while (queue_.empty()) {
    while (next_broadcast_ < m_.entries.size() && m_.entries[next_broadcast_].placement != Placement::kReplicate) {
      ++next_broadcast_;
    }
    if (next_broadcast_ < m_.entries.size()) {
      FillBroadcast(next_broadcast_++);
      continue;
    }
    if (next_shard_ >= m_.entries.size()) return false;
    FillBatch();
  }
  *out = std::move(queue_.front());
  queue_.pop_front();
  return true;
}

void Schedule::Push(Message&& m) {
  m.seq = seq_++;
  queue_.push_back(std::move(m));
}

// Elements [first, first + n) of an entry as single-segment messages to `dest`, each at most a chunk
// (or one part row, if larger), cut on part rows where the range is row-aligned; local offsets count
// from element `local_first`.
void Schedule::Split(uint32_t entry, int dest, uint64_t first, uint64_t n, uint64_t local_first) {
  const ManifestEntry& e = m_.entries[entry];
  uint64_t at = first;
  ForEachPart(e, first, n, [&](uint32_t part, uint64_t within, uint64_t count) {
    const ManifestPart& p = e.parts[part];
    const uint64_t widest = std::max(DTypeSize(p.source_dtype), DTypeSize(e.target_dtype));
    const uint64_t row = std::max<uint64_t>(1, p.row_elems());
    const uint64_t unit = within % row == 0 && count % row == 0 ? row : 1;
    const uint64_t per = std::max(unit, chunk_ / widest / unit * unit);
    for (uint64_t done = 0; done < count; done += per) {
      const uint64_t k = std::min(per, count - done);
      Segment s = MakeSegment(e, entry, part, within + done, k, at + done - local_first);
      Push(Message{0, dest, {s}, s.target_bytes});
    }
    at += count;
  });
}

void Schedule::FillBroadcast(uint32_t e) {
  const uint64_t n = Numel(m_.entries[e].shape);
  if (n > 0) Split(e, kBroadcast, 0, n, 0);
}

void Schedule::FillBatch() {
  std::vector<uint32_t> batch;
  uint64_t bytes = 0;
  const uint64_t limit = chunk_ * static_cast<uint64_t>(world_);
  while (next_shard_ < m_.entries.size() && (batch.empty() || bytes < limit)) {
    const ManifestEntry& e = m_.entries[next_shard_];
    if (e.placement == Placement::kShard) {
      batch.push_back(next_shard_);
      bytes += Numel(e.shape) * DTypeSize(e.target_dtype);
    }
    ++next_shard_;
  }
  for (int r = 0; r < world_; ++r) EmitRank(r, batch);
}

void Schedule::EmitRank(int r, const std::vector<uint32_t>& batch) {
  Message pack{0, r, {}, 0};
  auto flush = [&] {
    if (!pack.segments.empty()) Push(std::move(pack));
    pack = Message{0, r, {}, 0};
  };
  for (uint32_t i : batch) {
    const ManifestEntry& e = m_.entries[i];
    const uint64_t rows = Rows(e), row_elems = rows ? Numel(e.shape) / rows : 0;
    const RowRange mine = ShardRows(rows, world_, r);
    const uint64_t first = mine.begin * row_elems, n = mine.rows() * row_elems;
    if (n == 0) continue;
    const uint64_t ts = DTypeSize(e.target_dtype);
    if (n * ts >= coalesce_) {  // large: its own chunk-sized messages, received in place
      flush();
      Split(i, r, first, n, first);
      continue;
    }
    if (pack.target_bytes + n * ts > coalesce_) flush();
    uint64_t at = first;
    ForEachPart(e, first, n, [&](uint32_t part, uint64_t within, uint64_t count) {
      pack.segments.push_back(MakeSegment(e, i, part, within, count, at - first));
      at += count;
    });
    pack.target_bytes += n * ts;
  }
  flush();
}

}  // namespace shardcast
