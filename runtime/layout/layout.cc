#include "runtime/layout/layout.h"

#include <algorithm>
#include <map>

#include "allocators/error.h"

namespace shardcast {
namespace {

// Appends the global spans behind local positions [a, b) of a dim whose local order is `spans`.
// REQUIRES: successive calls ask for ascending, non-overlapping ranges (a Shard's one chunk, a
// _StridedShard's sf chunks in order). The cursor resumes where the last call ended, so one placement
// costs O(spans + calls): a _StridedShard of a large split factor over a dim that an earlier one left in
// many spans would otherwise be their product (the manifest fuzzer found 12 s for one layout).
class SpanSelector {
 public:
  explicit SpanSelector(const std::vector<Span>& spans) : spans_(spans) {}
  void Select(uint64_t a, uint64_t b, std::vector<Span>* out) {
    while (i_ < spans_.size() && at_ + spans_[i_].size() <= a) at_ += spans_[i_++].size();
    uint64_t at = at_;
    for (size_t k = i_; k < spans_.size() && at < b; ++k) {
      const Span& s = spans_[k];
      const uint64_t lo = std::max(a, at), hi = std::min(b, at + s.size());
      if (lo < hi) {
        const Span piece{s.begin + (lo - at), s.begin + (hi - at)};
        if (!out->empty() && out->back().end == piece.begin) {
          out->back().end = piece.end;  // adjacent: one span
        } else {
          out->push_back(piece);
        }
      }
      at += s.size();
    }
  }

 private:
  const std::vector<Span>& spans_;
  size_t i_ = 0;    // the first span that may still hold a position at or past the last call's start
  uint64_t at_ = 0;  // local position of spans_[i_]
};

uint64_t Total(const std::vector<Span>& spans) {
  uint64_t n = 0;
  for (const Span& s : spans) n += s.size();
  return n;
}

std::string List(const std::vector<int>& v) {
  std::string out = "[";
  for (size_t i = 0; i < v.size(); ++i) out += (i ? ", " : "") + std::to_string(v[i]);
  return out + "]";
}

}  // namespace

// [min(L, c * ceil(L/n)), min(L, that + ceil(L/n))).
Span ChunkSpan(uint64_t length, uint64_t n, uint64_t c) {
  const uint64_t size = (length + n - 1) / n;
  const uint64_t begin = std::min(length, c * size);
  return Span{begin, std::min(length, begin + size)};
}

std::string Placement::Text() const {
  switch (kind) {
    case kReplicate: return "Replicate()";
    case kShard: return "Shard(dim=" + std::to_string(dim) + ")";
    case kStridedShard:
      return "_StridedShard(dim=" + std::to_string(dim) + ", sf=" + std::to_string(split_factor) + ")";
  }
  return "?";
}

bool Layout::replicated() const {
  return boxes.empty() && std::all_of(placements.begin(), placements.end(),
                     [](const Placement& p) { return p.kind == Placement::kReplicate; });
}

std::string Layout::Text() const {
  if (!boxes.empty()) {
    std::string out = "boxes over ranks " + List(ranks) + ":";
    for (size_t i = 0; i < boxes.size() && i < 8; ++i) {
      // A layout that Check refuses for a missing rank is named by this text too: no rank, "?".
      out += (i ? "," : "") + std::string(" rank ") + (i < ranks.size() ? std::to_string(ranks[i]) : "?") + " [";
      for (size_t d = 0; d < boxes[i].offset.size(); ++d) {
        out += (d ? ", " : "") + std::to_string(boxes[i].offset[d]) + ":" +
               std::to_string(boxes[i].offset[d] + (d < boxes[i].size.size() ? boxes[i].size[d] : 0));
      }
      out += "]";
    }
    return out + (boxes.size() > 8 ? " ..." : "");
  }
  if (mesh_shape.empty()) return "Replicate on every rank";
  std::string out = "mesh (";
  for (size_t i = 0; i < mesh_shape.size(); ++i) out += (i ? ", " : "") + std::to_string(mesh_shape[i]);
  out += mesh_shape.size() == 1 ? ",)" : ")";
  out += " over ranks " + List(ranks) + ": (";
  for (size_t i = 0; i < placements.size(); ++i) out += (i ? ", " : "") + placements[i].Text();
  return out + ")";
}

void Layout::Check(const std::vector<uint64_t>& shape, const std::string& what) const {
  auto bad = [&](const std::string& why) { throw Error(ErrorKind::kInvalidArgument, what, Text() + ": " + why); };
  const size_t ndim = shape.size();
  if (!boxes.empty()) {
    if (!mesh_shape.empty() || !placements.empty()) bad("explicit boxes take no mesh and no placements");
    if (ranks.size() != boxes.size()) bad("one rank per box is needed");
    for (size_t i = 0; i < boxes.size(); ++i) {
      const Box& b = boxes[i];
      if (b.offset.size() != ndim || b.size.size() != ndim) {
        bad("rank " + std::to_string(ranks[i]) + "'s box has " + std::to_string(b.offset.size()) +
            " dim(s), the tensor " + std::to_string(ndim));
      }
      for (size_t d = 0; d < ndim; ++d) {
        if (b.offset[d] > shape[d] || b.size[d] > shape[d] - b.offset[d]) {
          bad("rank " + std::to_string(ranks[i]) + "'s box reaches " + std::to_string(b.offset[d]) + " + " +
              std::to_string(b.size[d]) + " in dim " + std::to_string(d) + " of size " + std::to_string(shape[d]));
        }
      }
    }
  } else if (placements.size() != mesh_shape.size()) {
    bad("one placement per mesh dim is needed");
  }
  uint64_t size = mesh_shape.empty() ? boxes.size() : 1;
  for (uint32_t d : mesh_shape) {
    if (d == 0) bad("a mesh dim of size 0");
    size *= d;
  }
  if (ranks.size() != size) bad("the mesh lists " + std::to_string(ranks.size()) + " ranks for its size " + std::to_string(size));
  std::vector<int> sorted = ranks;
  std::sort(sorted.begin(), sorted.end());
  if (std::adjacent_find(sorted.begin(), sorted.end()) != sorted.end() || (!sorted.empty() && sorted[0] < 0)) {
    bad("a rank appears twice, or is negative");
  }
  for (const Placement& p : placements) {
    if (p.kind == Placement::kReplicate) continue;
    if (p.dim < 0 || static_cast<size_t>(p.dim) >= ndim) {
      bad(p.Text() + " of a tensor with " + std::to_string(ndim) + " dim(s)");
    }
    if (p.kind == Placement::kStridedShard && p.split_factor == 0) bad("a split factor of 0");
  }
}

void Layout::CheckKey(const std::vector<uint64_t>& shape, const std::string& key) const {
  try {
    Check(shape, "");
  } catch (const Error& e) {
    throw Error(e.kind(), "key '" + key + "'", e.what());
  }
}

Layout DimZeroLayout(int world_size, int replicas) {
  Layout l;
  if (replicas <= 1) {
    l.mesh_shape = {static_cast<uint32_t>(world_size)};
    l.placements = {Placement{Placement::kShard, 0, 1}};
  } else {
    l.mesh_shape = {static_cast<uint32_t>(replicas), static_cast<uint32_t>(world_size / replicas)};
    l.placements = {Placement{}, Placement{Placement::kShard, 0, 1}};
  }
  for (int r = 0; r < world_size; ++r) l.ranks.push_back(r);
  return l;
}

Layout ReplicatedLayout() { return Layout{}; }

std::vector<uint64_t> Piece::LocalShape() const {
  std::vector<uint64_t> s;
  for (const auto& spans : dims) s.push_back(held ? Total(spans) : 0);
  return s;
}

uint64_t Piece::numel() const {
  if (!held) return 0;
  uint64_t n = 1;
  for (const auto& spans : dims) n *= Total(spans);
  return n;
}

Piece PieceOf(const std::vector<uint64_t>& shape, const Layout& layout, int rank) {
  Piece p;
  for (uint64_t n : shape) p.dims.push_back(n ? std::vector<Span>{Span{0, n}} : std::vector<Span>{});
  if (layout.mesh_shape.empty() && layout.boxes.empty()) return p;
  auto it = std::find(layout.ranks.begin(), layout.ranks.end(), rank);
  if (it == layout.ranks.end()) {
    p.held = false;
    for (auto& spans : p.dims) spans.clear();
    return p;
  }
  if (!layout.boxes.empty()) {
    const Box& b = layout.boxes[static_cast<size_t>(it - layout.ranks.begin())];
    for (size_t d = 0; d < shape.size(); ++d) {
      p.dims[d] = b.size[d] ? std::vector<Span>{Span{b.offset[d], b.offset[d] + b.size[d]}} : std::vector<Span>{};
    }
    return p;
  }
  // The rank's coordinate, row-major.
  uint64_t flat = static_cast<uint64_t>(it - layout.ranks.begin());
  std::vector<uint64_t> coord(layout.mesh_shape.size());
  for (size_t d = layout.mesh_shape.size(); d-- > 0;) {
    coord[d] = flat % layout.mesh_shape[d];
    flat /= layout.mesh_shape[d];
  }
  for (size_t m = 0; m < layout.placements.size(); ++m) {
    const Placement& pl = layout.placements[m];
    if (pl.kind == Placement::kReplicate) continue;
    std::vector<Span>& spans = p.dims[pl.dim];
    const uint64_t length = Total(spans), n = layout.mesh_shape[m], c = coord[m];
    std::vector<Span> next;
    SpanSelector select(spans);
    if (pl.kind == Placement::kShard) {
      const Span s = ChunkSpan(length, n, c);
      select.Select(s.begin, s.end, &next);
    } else {
      for (uint64_t j = 0; j < pl.split_factor; ++j) {
        const Span outer = ChunkSpan(length, pl.split_factor, j);
        if (outer.begin == length) break;  // the trailing chunks of a split factor past the length: empty
        const Span inner = ChunkSpan(outer.size(), n, c);
        select.Select(outer.begin + inner.begin, outer.begin + inner.end, &next);
      }
    }
    spans = std::move(next);
  }
  return p;
}

std::vector<Holding> Holdings(const std::vector<uint64_t>& shape, const Layout& layout, int world_size) {
  std::vector<Holding> out;
  std::map<std::vector<uint64_t>, size_t> index;  // a piece's spans, flattened: O(W log W), not W^2
  for (int r = 0; r < world_size; ++r) {
    Piece p = PieceOf(shape, layout, r);
    if (p.numel() == 0) continue;
    std::vector<uint64_t> key;
    for (const auto& spans : p.dims) {
      key.push_back(spans.size());
      for (const Span& s : spans) key.insert(key.end(), {s.begin, s.end});
    }
    auto [it, fresh] = index.emplace(std::move(key), out.size());
    if (fresh) {
      out.push_back(Holding{std::move(p), {r}});
    } else {
      out[it->second].holders.push_back(r);
    }
  }
  return out;
}

}  // namespace shardcast
