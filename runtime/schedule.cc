#include "runtime/schedule.h"

#include <algorithm>
#include <unordered_map>

#include "allocators/error.h"

namespace shardcast {

Schedule::Schedule(const Manifest& m)
    : m_(m), world_(m.world_size), chunk_(std::max<uint64_t>(1, m.params.chunk_bytes)),
      coalesce_(std::min(m.params.coalesce_bytes, m.params.chunk_bytes)) {}

const Schedule::Pieces& Schedule::PiecesOf(uint32_t entry) {
  if (pieces_of_.empty()) pieces_of_.assign(m_.entries.size(), nullptr);
  if (pieces_of_[entry] != nullptr) return *pieces_of_[entry];
  const ManifestEntry& e = m_.entries[entry];
  auto key = std::make_pair(e.layout, e.shape);
  auto it = pieces_.find(key);
  if (it != pieces_.end()) return *(pieces_of_[entry] = &it->second);
  Pieces p;
  p.holdings = Holdings(e.shape, m_.LayoutOf(e), world_);
  for (const Holding& h : p.holdings) {
    auto& set = holder_sets_[h.holders];
    if (!set) set = std::make_shared<const std::vector<int>>(h.holders);
    p.holders.push_back(set);
  }
  uint64_t numel = 1;
  for (uint64_t d : e.shape) numel *= d;
  p.broadcast = p.holdings.size() == 1 && p.holdings[0].holders.size() == static_cast<size_t>(world_) &&
                p.holdings[0].piece.numel() == numel;
  return *(pieces_of_[entry] = &pieces_.emplace(std::move(key), std::move(p)).first->second);
}

bool Schedule::Next(Message* out) {
  while (queue_.empty()) {
    while (next_broadcast_ < m_.entries.size() && !PiecesOf(next_broadcast_).broadcast) ++next_broadcast_;
    if (next_broadcast_ < m_.entries.size()) {
      const uint32_t e = next_broadcast_++;
      const Pieces& p = PiecesOf(e);
      ForEachRuns(m_.entries[e].shape, p.holdings[0].piece, [&](const StridedRuns& r) {
        Cut(e, r, [&](Segment&& s) {
          const uint64_t bytes = s.target_bytes;
          Push(Message{0, kBroadcast, nullptr, {s}, bytes});
        });
      });
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

// Consecutive entries up to world x chunk bytes; their pieces grouped by holder set, each group's
// pieces packed (small) or split into chunks (large).
void Schedule::FillBatch() {
  struct Item {
    uint32_t entry;
    const Holding* holding;
  };
  std::vector<std::pair<std::shared_ptr<const std::vector<int>>, std::vector<Item>>> groups;
  std::unordered_map<const std::vector<int>*, size_t> group_of;  // by interned holder set
  uint64_t bytes = 0;
  const uint64_t limit = chunk_ * static_cast<uint64_t>(world_);
  bool any = false;
  while (next_shard_ < m_.entries.size() && (!any || bytes < limit)) {
    const uint32_t i = next_shard_++;
    const Pieces& p = PiecesOf(i);
    if (p.broadcast) continue;
    any = true;
    const ManifestEntry& e = m_.entries[i];
    uint64_t numel = 1;
    for (uint64_t d : e.shape) numel *= d;
    bytes += numel * DTypeSize(e.target_dtype);
    for (size_t h = 0; h < p.holdings.size(); ++h) {
      auto [it, fresh] = group_of.try_emplace(p.holders[h].get(), groups.size());
      if (fresh) groups.push_back({p.holders[h], {}});
      groups[it->second].second.push_back(Item{i, &p.holdings[h]});
    }
  }
  for (auto& group : groups) {
    // Not a structured binding: the lambdas below capture `holders`, which C++17 (clang) forbids for a binding.
    const auto& holders = group.first;
    const auto& items = group.second;
    const int dest = holders->front();
    Message pack{0, dest, holders, {}, 0};
    auto flush = [&] {
      if (!pack.segments.empty()) Push(std::move(pack));
      pack = Message{0, dest, holders, {}, 0};
    };
    for (const Item& item : items) {
      const ManifestEntry& e = m_.entries[item.entry];
      const uint64_t n = item.holding->piece.numel() * DTypeSize(e.target_dtype);
      const bool large = n >= coalesce_;
      if (large) flush();
      if (!large && pack.target_bytes + n > coalesce_) flush();
      ForEachRuns(e.shape, item.holding->piece, [&](const StridedRuns& r) {
        Cut(item.entry, r, [&](Segment&& s) {
          if (large) {
            const uint64_t b = s.target_bytes;
            Push(Message{0, dest, holders, {s}, b});
          } else {
            pack.target_bytes += s.target_bytes;
            pack.segments.push_back(s);
          }
        });
      });
    }
    flush();
  }
}

// The runs r of an entry, cut on its parts (a composed entry's parts are consecutive in its elements):
// the runs that lie inside one part form one strided window; a run across a part boundary is cut.
template <typename F>
void Schedule::Cut(uint32_t entry, const StridedRuns& r, F&& fn) {
  const ManifestEntry& e = m_.entries[entry];
  if (part_starts_of_ != entry) {
    part_starts_.assign(1, 0);
    for (const ManifestPart& p : e.parts) part_starts_.push_back(part_starts_.back() + p.numel);
    part_starts_of_ = entry;
  }
  const uint64_t ts = DTypeSize(e.target_dtype);
  auto part_at = [&](uint64_t element) {
    return static_cast<uint32_t>(std::upper_bound(part_starts_.begin(), part_starts_.end(), element) -
                                 part_starts_.begin() - 1);
  };
  uint64_t i = 0;
  while (i < r.runs) {
    const uint64_t s = r.first + i * r.stride;
    const uint32_t p = part_at(s);
    if (p >= e.parts.size()) throw Error(ErrorKind::kInternal, e.key, "a run past the entry's parts");
    const uint64_t end = part_starts_[p + 1];
    if (s + r.count <= end) {
      uint64_t j = i;
      if (r.runs > 1 && r.stride > 0) j = std::min(r.runs - 1, i + (end - r.count - s) / r.stride);
      Chunks(entry, p, s - part_starts_[p], r.count, j - i + 1, r.stride, (r.local_first + i * r.local_stride) * ts,
             r.local_stride * ts, fn);
      i = j + 1;
      continue;
    }
    uint64_t at = s, left = r.count, local = r.local_first + i * r.local_stride;
    while (left > 0) {
      const uint32_t q = part_at(at);
      const uint64_t k = std::min(left, part_starts_[q + 1] - at);
      Chunks(entry, q, at - part_starts_[q], k, 1, k, local * ts, k * ts, fn);
      at += k, local += k, left -= k;
    }
    ++i;
  }
}

// A strided window of one part as segments of at most a chunk: several runs per segment where a run is
// smaller than a chunk, else each run alone, cut on the part's rows where the run is row-aligned.
template <typename F>
void Schedule::Chunks(uint32_t entry, uint32_t part, uint64_t within, uint64_t count, uint64_t runs, uint64_t stride,
                      uint64_t local, uint64_t local_stride, F&& fn) {
  const ManifestEntry& e = m_.entries[entry];
  const ManifestPart& p = e.parts[part];
  const uint64_t ss = DTypeSize(p.source_dtype), ts = DTypeSize(e.target_dtype), widest = std::max(ss, ts);
  auto emit = [&](uint64_t first, uint64_t k, uint64_t n, uint64_t at) {
    const uint64_t st = n > 1 ? stride : k, lst = n > 1 ? local_stride : k * ts;
    fn(Segment{entry, part, first, k, n, st, p.offset + first * ss, n * k * ss, at, lst, n * k * ts});
  };
  if (runs > 1 && count * widest <= chunk_) {
    const uint64_t per = std::max<uint64_t>(1, chunk_ / (count * widest));
    for (uint64_t done = 0; done < runs; done += per) {
      emit(within + done * stride, count, std::min(per, runs - done), local + done * local_stride);
    }
    return;
  }
  for (uint64_t run = 0; run < runs; ++run) {
    const uint64_t first = within + run * stride, at = local + run * local_stride;
    const uint64_t row = std::max<uint64_t>(1, p.row_elems());
    const uint64_t unit = first % row == 0 && count % row == 0 ? row : 1;
    const uint64_t per = std::max(unit, chunk_ / widest / unit * unit);
    for (uint64_t done = 0; done < count; done += per) emit(first + done, std::min(per, count - done), 1, at + done * ts);
  }
}

}  // namespace shardcast
