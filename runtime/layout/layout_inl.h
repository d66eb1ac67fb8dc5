// runtime/layout/layout_inl.h: ForEachRuns, the box-to-runs walk (included by layout.h only).
//
// For a box with offsets o, lengths l in a global tensor g, and local offsets lo in the local shape ls:
// k is the outermost dim from which every inner dim is whole (l[d] == g[d] for d > k). One run is
// l[k] * prod(g[k+1:]) elements; dim k-1 gives the runs of one StridedRuns (global stride prod(g[k:]),
// local stride prod(ls[k:])); dims 0..k-2 are walked one index at a time.
//
//   g = [2, 4, 6], box rows [1,3) cols [2,4) of both experts:  k = 2, run = 2 elements,
//   per expert e: runs = 2 (rows), stride 6, first = e*24 + 1*6 + 2
#pragma once

#include <algorithm>
#include <array>
#include <vector>

namespace shardcast {
namespace layout_detail {

// Per-dim values without a heap allocation for the usual ranks (the walk runs once per box and rank,
// hundreds of thousands of times at DeepSeek-V3's scale); a tensor of more dims spills to the heap.
// Written out rather than c10::SmallVector so that layouts need no libtorch (the planning core).
class DimValues {
 public:
  explicit DimValues(size_t n, uint64_t value = 0) {
    if (n > inline_.size()) {
      heap_.assign(n, value);
      data_ = heap_.data();
    } else {
      std::fill_n(inline_.begin(), n, value);
    }
  }
  DimValues(const DimValues&) = delete;  // data_ may point into this object
  DimValues& operator=(const DimValues&) = delete;
  uint64_t* data() { return data_; }
  uint64_t& operator[](size_t i) { return data_[i]; }

 private:
  std::array<uint64_t, 6> inline_;
  std::vector<uint64_t> heap_;
  uint64_t* data_ = inline_.data();
};

// g: the global shape, ls: the local shape, o/l/lo: the box's offsets, lengths and local offsets; nd each.
template <typename F>
void WalkBox(size_t nd, const uint64_t* g, const uint64_t* ls, const uint64_t* o, const uint64_t* l,
             const uint64_t* lo, F& fn) {
  if (nd == 0) {
    fn(StridedRuns{0, 1, 1, 1, 0, 1});
    return;
  }
  for (size_t d = 0; d < nd; ++d) {
    if (l[d] == 0) return;
  }
  DimValues gs(nd, 1), lss(nd, 1);  // row-major strides in elements
  for (size_t d = nd - 1; d > 0; --d) {
    gs[d - 1] = gs[d] * g[d];
    lss[d - 1] = lss[d] * ls[d];
  }
  size_t k = nd - 1;
  while (k > 0 && l[k] == g[k]) --k;
  const uint64_t count = l[k] * gs[k];
  StridedRuns r;
  r.count = count;
  if (k == 0) {
    r.first = o[0] * gs[0];
    r.local_first = lo[0] * lss[0];
    r.runs = 1;
    r.stride = r.local_stride = count;
    fn(r);
    return;
  }
  r.runs = l[k - 1];
  r.stride = gs[k - 1];
  r.local_stride = lss[k - 1];
  // The outer dims 0..k-2, one index at a time (an odometer).
  DimValues idx(k - 1, 0);
  while (true) {
    uint64_t first = o[k - 1] * gs[k - 1] + o[k] * gs[k], local = lo[k - 1] * lss[k - 1] + lo[k] * lss[k];
    for (size_t d = 0; d + 1 < k; ++d) {
      first += (o[d] + idx[d]) * gs[d];
      local += (lo[d] + idx[d]) * lss[d];
    }
    r.first = first;
    r.local_first = local;
    fn(r);
    size_t d = k - 1;
    while (d > 0) {
      if (++idx[d - 1] < l[d - 1]) break;
      idx[d - 1] = 0;
      --d;
    }
    if (d == 0) return;
  }
}

}  // namespace layout_detail

template <typename F>
void ForEachRuns(const std::vector<uint64_t>& shape, const Piece& piece, F&& fn) {
  if (!piece.held) return;
  const size_t nd = shape.size();
  if (nd == 0) {
    layout_detail::WalkBox(0, nullptr, nullptr, nullptr, nullptr, nullptr, fn);
    return;
  }
  layout_detail::DimValues ls(nd, 0);
  for (size_t d = 0; d < nd; ++d) {
    for (const Span& s : piece.dims[d]) ls[d] += s.size();
  }
  // Every box: one span per dim (an odometer over the span lists), with its local offsets.
  layout_detail::DimValues pick(nd, 0);
  for (size_t d = 0; d < nd; ++d) {
    if (piece.dims[d].empty()) return;
  }
  layout_detail::DimValues o(nd), l(nd), lo(nd);
  while (true) {
    for (size_t d = 0; d < nd; ++d) {
      uint64_t local = 0;
      for (size_t i = 0; i < pick[d]; ++i) local += piece.dims[d][i].size();
      o[d] = piece.dims[d][pick[d]].begin;
      l[d] = piece.dims[d][pick[d]].size();
      lo[d] = local;
    }
    layout_detail::WalkBox(nd, shape.data(), ls.data(), o.data(), l.data(), lo.data(), fn);
    size_t d = nd;
    while (d > 0) {
      if (++pick[d - 1] < piece.dims[d - 1].size()) break;
      pick[d - 1] = 0;
      --d;
    }
    if (d == 0) return;
  }
}

}  // namespace shardcast
