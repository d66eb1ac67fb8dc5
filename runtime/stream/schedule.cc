#include "runtime/stream/schedule.h"

#include <algorithm>
#include <tuple>

#include "allocators/error.h"

namespace shardcast {

Schedule::Schedule(const Manifest& m, Interest interest)
    : m_(m), interest_(std::move(interest)), world_(m.world_size), chunk_(std::max<uint64_t>(1, m.params.chunk_bytes)),
      coalesce_(std::min(m.params.coalesce_bytes, m.params.chunk_bytes)),
      sets_(static_cast<size_t>(std::max(0, m.world_size))), wanted_(sets_.size(), 0) {}

uint32_t Schedule::SetId(const std::vector<int>& holders) {
  uint32_t id;
  if (holders.size() == 1 && holders[0] >= 0 && holders[0] < world_) {
    id = static_cast<uint32_t>(holders[0]);
  } else {
    auto [it, fresh] = set_ids_.try_emplace(holders, static_cast<uint32_t>(sets_.size()));
    if (fresh) sets_.emplace_back(), wanted_.push_back(0);
    id = it->second;
  }
  if (!sets_[id]) {
    sets_[id] = std::make_shared<const std::vector<int>>(holders);
    wanted_[id] = !interest_.pieces || interest_.pieces(holders);
  }
  return id;
}

const Schedule::Pieces& Schedule::PiecesOf(uint32_t entry) {
  if (pieces_of_.empty()) pieces_of_.assign(m_.entries.size(), nullptr);
  if (pieces_of_[entry] != nullptr) return *pieces_of_[entry];
  const ManifestEntry& e = m_.entries[entry];
  auto key = std::make_pair(e.layout, e.shape);
  auto it = pieces_.find(key);
  if (it != pieces_.end()) return *(pieces_of_[entry] = &it->second);
  Pieces& p = pieces_.emplace(std::move(key), Pieces{}).first->second;
  holdings_ = Holdings(e.shape, m_.LayoutOf(e), world_);
  holdings_of_ = &p;
  uint64_t numel = 1;
  for (uint64_t d : e.shape) numel *= d;
  p.broadcast = holdings_.size() == 1 && holdings_[0].holders.size() == static_cast<size_t>(world_) &&
                holdings_[0].piece.numel() == numel;
  for (uint32_t h = 0; h < holdings_.size(); ++h) {
    p.ids.push_back(SetId(holdings_[h].holders));
    if (p.broadcast || wanted_[p.ids.back()]) p.kept.emplace_back(h, holdings_[h].piece);
  }
  return *(pieces_of_[entry] = &p);
}

const Piece& Schedule::Pieces::KeptPiece(uint32_t holding) const {
  auto it = std::lower_bound(kept.begin(), kept.end(), holding,
                             [](const std::pair<uint32_t, Piece>& k, uint32_t h) { return k.first < h; });
  if (it == kept.end() || it->first != holding) {
    throw Error(ErrorKind::kInternal, "schedule", "a piece cut that was only counted");
  }
  return it->second;
}

const std::vector<Holding>& Schedule::HoldingsOf(uint32_t entry, const Pieces& p) {
  if (holdings_of_ != &p) {
    const ManifestEntry& e = m_.entries[entry];
    holdings_ = Holdings(e.shape, m_.LayoutOf(e), world_);
    holdings_of_ = &p;
  }
  return holdings_;
}

// An entry's holdings as bands: what counting a batch needs of them, the same for every entry whose
// pieces, target dtype and parts' sizes and rows are the same (the layers of a model).
const Schedule::Counted& Schedule::CountedOf(uint32_t entry) {
  if (counted_of_.empty()) counted_of_.assign(m_.entries.size(), nullptr);
  if (counted_of_[entry] != nullptr) return *counted_of_[entry];
  const ManifestEntry& e = m_.entries[entry];
  const Pieces& p = PiecesOf(entry);
  std::vector<uint64_t> key{reinterpret_cast<uintptr_t>(&p), static_cast<uint64_t>(e.target_dtype)};
  for (const ManifestPart& part : e.parts) {
    key.insert(key.end(), {part.numel, DTypeSize(part.source_dtype), part.row_elems()});
  }
  auto [it, fresh] = counted_.try_emplace(std::move(key));
  Counted& c = it->second;
  if (fresh) {
    c.pieces = &p;
    const uint64_t ts = DTypeSize(e.target_dtype);
    const std::vector<Holding>& holdings = HoldingsOf(entry, p);
    for (uint32_t h = 0; h < holdings.size(); ++h) {
      const uint64_t n = holdings[h].piece.numel() * ts;
      uint64_t segments = 0;
      if (n >= coalesce_) {
        ForEachRuns(e.shape, holdings[h].piece, [&](const StridedRuns& r) { Cut(entry, r, [&](Segment&&) { ++segments; }); });
      }
      Band* last = c.bands.empty() ? nullptr : &c.bands.back();
      if (last != nullptr && p.ids[h] == last->id + last->ids && h == last->holding + last->ids && n == last->bytes &&
          segments == last->segments) {
        ++last->ids;
      } else {
        c.bands.push_back(Band{p.ids[h], 1, h, n, segments});
      }
    }
    std::sort(c.bands.begin(), c.bands.end(), [](const Band& x, const Band& y) { return x.id < y.id; });
  }
  return *(counted_of_[entry] = &c);
}

bool Schedule::Next(Message* out) {
  while (queue_.empty()) {
    while (next_broadcast_ < m_.entries.size() && !PiecesOf(next_broadcast_).broadcast) ++next_broadcast_;
    if (next_broadcast_ < m_.entries.size()) {
      const uint32_t e = next_broadcast_++;
      const Pieces& p = PiecesOf(e);
      ForEachRuns(m_.entries[e].shape, p.KeptPiece(0), [&](const StridedRuns& r) {
        Cut(e, r, [&](Segment&& s) {
          const uint64_t bytes = s.target_bytes, seq = seq_++;
          if (interest_.broadcasts) Push(Message{seq, kBroadcast, nullptr, {s}, bytes});
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

void Schedule::Push(Message&& m) { queue_.push_back(std::move(m)); }

// A run of holder-set ids [begin, end) that every entry of a batch so far treated alike: each of them
// has sent `count` messages and holds `packed` bytes in an open pack. They first appeared in the batch's
// entry `entry`, as its holdings from `holding` on: groups are ordered by that.
struct Schedule::Group {
  uint32_t begin = 0, end = 0;
  uint32_t entry = 0, holding = 0;
  uint64_t count = 0, packed = 0;
  bool open = false;
};

// Every group's message count in a batch, from its pieces' bytes alone, in order of first appearance.
// What FillBatch's cut does, counted: a large piece flushes the open pack and is `segments` messages; a
// small one joins the pack unless that would pass the coalescing size.
void Schedule::CountBatch(const std::vector<uint32_t>& batch, std::vector<Group>* out) {
  std::map<uint32_t, Group> groups;  // by begin; disjoint
  auto split = [&](uint32_t at) {
    auto it = groups.upper_bound(at);
    if (it == groups.begin()) return;
    Group& g = (--it)->second;
    if (g.begin == at || g.end <= at) return;
    Group tail = g;
    tail.begin = at;
    tail.holding += at - g.begin;
    g.end = at;
    groups.emplace(at, tail);
  };
  for (uint32_t j = 0; j < batch.size(); ++j) {
    const Counted& c = CountedOf(batch[j]);
    for (const Band& band : c.bands) {
      const uint32_t end = band.id + band.ids;
      split(band.id);
      split(end);
      auto it = groups.lower_bound(band.id);
      for (uint32_t at = band.id; at < end; ++it) {
        if (it == groups.end() || it->first > at) {  // first met in this entry
          const uint32_t to = it == groups.end() ? end : std::min(end, it->first);
          it = groups.emplace_hint(it, at, Group{at, to, j, band.holding + (at - band.id)});
        }
        Group& g = it->second;
        if (band.segments > 0) {
          g.count += g.open + band.segments;
          g.open = false, g.packed = 0;
        } else {
          if (g.open && g.packed + band.bytes > coalesce_) ++g.count, g.packed = 0;
          g.packed += band.bytes;
          g.open = true;
        }
        at = g.end;
      }
    }
  }
  out->clear();
  for (auto& [begin, g] : groups) {
    g.count += g.open;
    out->push_back(g);
  }
  std::sort(out->begin(), out->end(),
            [](const Group& x, const Group& y) { return std::tie(x.entry, x.holding) < std::tie(y.entry, y.holding); });
}

// Consecutive entries up to world x chunk bytes; their pieces grouped by holder set, each group's
// pieces packed (small) or split into chunks (large). Counted for every group, cut for the wanted ones.
void Schedule::FillBatch() {
  std::vector<uint32_t> batch;
  uint64_t bytes = 0;
  const uint64_t limit = chunk_ * static_cast<uint64_t>(world_);
  while (next_shard_ < m_.entries.size() && (batch.empty() || bytes < limit)) {
    const uint32_t i = next_shard_++;
    if (PiecesOf(i).broadcast) continue;
    batch.push_back(i);
    const ManifestEntry& e = m_.entries[i];
    uint64_t numel = 1;
    for (uint64_t d : e.shape) numel *= d;
    bytes += numel * DTypeSize(e.target_dtype);
  }
  std::vector<Group> groups;
  CountBatch(batch, &groups);
  for (const Group& g : groups) {
    for (uint32_t id = g.begin; id < g.end; ++id, seq_ += g.count) {
      if (!wanted_[id]) continue;
      if (CutGroup(batch, id, seq_) != g.count) {
        throw Error(ErrorKind::kInternal, std::string(m_.entries[batch[g.entry]].key), "a group's messages differ from its count");
      }
    }
  }
}

// The messages of holder set `id` in a batch, numbered from `seq`; returns how many.
uint64_t Schedule::CutGroup(const std::vector<uint32_t>& batch, uint32_t id, uint64_t seq) {
  const auto& holders = sets_[id];
  const int dest = holders->front();
  const uint64_t first = seq;
  Message pack{0, dest, holders, {}, 0};
  auto flush = [&] {
    if (!pack.segments.empty()) {
      pack.seq = seq++;
      Push(std::move(pack));
    }
    pack = Message{0, dest, holders, {}, 0};
  };
  for (uint32_t entry : batch) {
    const Counted& c = CountedOf(entry);
    auto band = std::upper_bound(c.bands.begin(), c.bands.end(), id, [](uint32_t x, const Band& b) { return x < b.id; });
    if (band == c.bands.begin() || id >= (--band)->id + band->ids) continue;
    const Piece& piece = c.pieces->KeptPiece(band->holding + (id - band->id));
    const ManifestEntry& e = m_.entries[entry];
    const uint64_t n = piece.numel() * DTypeSize(e.target_dtype);
    const bool large = n >= coalesce_;
    if (large) flush();
    if (!large && pack.target_bytes + n > coalesce_) flush();
    ForEachRuns(e.shape, piece, [&](const StridedRuns& r) {
      Cut(entry, r, [&](Segment&& s) {
        if (large) {
          const uint64_t b = s.target_bytes;
          Push(Message{seq++, dest, holders, {s}, b});
        } else {
          pack.target_bytes += s.target_bytes;
          pack.segments.push_back(s);
        }
      });
    });
  }
  flush();
  return seq - first;
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
    if (p >= e.parts.size()) throw Error(ErrorKind::kInternal, std::string(e.key), "a run past the entry's parts");
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

ScheduleWalk::ScheduleWalk(std::unique_ptr<Schedule> schedule, int cursors)
    : schedule_(std::move(schedule)), at_(static_cast<size_t>(cursors), 0) {}

std::shared_ptr<const Message> ScheduleWalk::Next(int cursor) {
  std::lock_guard<std::mutex> l(mu_);
  uint64_t& at = at_[cursor];
  if (at == UINT64_MAX) throw Error(ErrorKind::kInternal, "schedule", "a closed cursor read on");
  while (at - base_ >= window_.size()) {
    Message msg;
    if (done_ || !schedule_->Next(&msg)) {
      done_ = true;
      return nullptr;
    }
    window_.push_back(std::make_shared<const Message>(std::move(msg)));
  }
  std::shared_ptr<const Message> out = window_[at - base_];
  ++at;
  Trim();
  return out;
}

void ScheduleWalk::Close(int cursor) {
  std::lock_guard<std::mutex> l(mu_);
  at_[cursor] = UINT64_MAX;
  Trim();
}

void ScheduleWalk::Trim() {
  const uint64_t slowest = *std::min_element(at_.begin(), at_.end());
  while (base_ < slowest && !window_.empty()) {
    window_.pop_front();
    ++base_;
  }
}

}  // namespace shardcast
