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

}  // namespace

Schedule::Schedule(const Manifest& m, int world_size, uint64_t chunk_bytes, uint64_t coalesce_bytes)
    : m_(m), world_(world_size), chunk_(chunk_bytes), coalesce_(std::min(coalesce_bytes, chunk_bytes)) {}

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

// Calls fn(part, element offset within the part, count) for the parts that supply elements
// [first, first + n) of an entry, in order.
template <typename F>
static void ForEachPart(const ManifestEntry& e, uint64_t first, uint64_t n, F&& fn) {
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

static Segment MakeSegment(const ManifestEntry& e, uint32_t index, uint32_t part, uint64_t within, uint64_t k,
                           uint64_t local_elem) {
  const ManifestPart& p = e.parts[part];
  const uint64_t ss = DTypeSize(p.source_dtype), ts = DTypeSize(e.target_dtype);
  return Segment{index, part, p.offset + within * ss, k * ss, local_elem * ts, k * ts};
}

// Elements [first, first + n) of entry e as chunk-sized single-segment messages to `dest` (received
// in place), never crossing a part; local offsets count from element `local_first`.
static void SplitElements(const ManifestEntry& e, uint32_t index, int dest, uint64_t first, uint64_t n,
                          uint64_t local_first, uint64_t chunk, std::deque<Message, HostStlAllocator<Message>>* q) {
  uint64_t at = first;
  ForEachPart(e, first, n, [&](uint32_t part, uint64_t within, uint64_t count) {
    const uint64_t widest = std::max(DTypeSize(e.parts[part].source_dtype), DTypeSize(e.target_dtype));
    const uint64_t per = std::max<uint64_t>(1, chunk / widest);
    for (uint64_t done = 0; done < count; done += per) {
      const uint64_t k = std::min(per, count - done);
      Segment s = MakeSegment(e, index, part, within + done, k, at + done - local_first);
      q->push_back(Message{dest, {s}, s.target_bytes});
    }
    at += count;
  });
}

void Schedule::FillBroadcast(uint32_t e) {
  const ManifestEntry& me = m_.entries[e];
  uint64_t n = Numel(me.shape);
  if (n > 0) SplitElements(me, e, kBroadcast, 0, n, 0, chunk_, &queue_);
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
  Message pack{r, {}, 0};
  auto flush = [&] {
    if (!pack.segments.empty()) queue_.push_back(std::move(pack));
    pack = Message{r, {}, 0};
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
      SplitElements(e, i, r, first, n, first, chunk_, &queue_);
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
