// runtime/layout/layout: what each rank holds of an entry, exactly as DTensor lays it out.
//
// A Layout is a DTensor's device mesh (its shape and the global rank at each coordinate) and one
// placement per mesh dim. A rank's Piece is, for every tensor dim, the list of global index spans it
// holds, in local order; the boxes of the global tensor it holds are their cartesian product. The
// placements are applied left to right over the mesh dims, each to the tensor the previous ones left:
//
//   Replicate          nothing changes
//   Shard(d)           torch.chunk along d: chunks of ceil(L / n), trailing ones smaller or empty
//   _StridedShard(d, sf)  split L into sf chunks, each of those into n chunks, and keep chunk c of each,
//                      concatenated (placement_types.py's _split_tensor): FSDP2 over TP on one dim
//
// Worked examples (n mesh ranks along the placement's mesh dim, c the rank's coordinate on it):
//
//   Shard(0), [5, 3], 1-d mesh of 4        rank 0 rows [0,2)  1 [2,4)  2 [4,5)  3 none (empty)
//   Shard(1), [4, 6], 1-d mesh of 4        cols [0,2) [2,4) [4,6) none; every row is one run:
//                                          rank 1:  . . X X . .   <- row 0
//                                                   . . X X . .   <- row 1 ...
//   (Replicate, Shard(0)) on (2, 3), [7]   HSDP: ranks 0,3 hold [0,3); 1,4 [3,6); 2,5 [6,7)
//   (_StridedShard(0, sf=2), Shard(0)) on (dp=2, tp=2), [8, 4]   (FSDP2 after TP's Colwise)
//       dp coord c keeps chunk c of each half: dp 0 -> rows {0,1} + {4,5}; dp 1 -> {2,3} + {6,7};
//       then tp chunks that:  rank (0,0) [0,2)  (0,1) [4,6)  (1,0) [2,4)  (1,1) [6,8)
//   _StridedShard(0, sf=2) alone on 4 ranks, [9]: halves [0,5) [5,9), each in 4 chunks:
//       rank 0 {0,1} + {5}   rank 1 {2,3} + {6}   rank 2 {4} + {7}   rank 3 {} + {8}  (two spans)
//
// A layout with no mesh dims is Replicate on every rank of the world. A rank that is not in the mesh
// holds nothing (held == false). The global shape is always explicit.
//
// Explicit boxes (code that shards without DTensor): no mesh, no placements; ranks[i] holds boxes[i],
// one box of the global tensor (offset and size per dim), as each rank declared it. Boxes may be
// empty, may leave elements to nobody, and may repeat (replicas):
//
//   [4, 6] over 3 ranks, boxes  rank 0 offset (0, 0) size (4, 2)     X X . . . .
//                               rank 1 offset (0, 2) size (2, 4)     . . Y Y Y Y   <- rows 0-1 only
//                               rank 2 offset (2, 2) size (2, 4)     . . Z Z Z Z   <- rows 2-3
//
// Thread safety: values; pure functions. Failure: kInvalidArgument naming the layout (a placement dim
// outside the tensor, a mesh whose rank list is not its size, a split factor of 0).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace shardcast {

struct Placement {
  enum Kind : uint8_t { kReplicate = 0, kShard = 1, kStridedShard = 2 };
  Kind kind = kReplicate;
  int dim = 0;                // kShard, kStridedShard
  uint32_t split_factor = 1;  // kStridedShard
  bool operator==(const Placement& o) const {
    return kind == o.kind && (kind == kReplicate || (dim == o.dim && (kind == kShard || split_factor == o.split_factor)));
  }
  std::string Text() const;  // "Shard(dim=1)", "_StridedShard(dim=0, sf=2)", "Replicate()"
};

struct Box {
  std::vector<uint64_t> offset, size;  // per tensor dim, global
  bool operator==(const Box& o) const { return offset == o.offset && size == o.size; }
};

struct Layout {
  std::vector<uint32_t> mesh_shape;   // empty: Replicate on every rank of the world (unless boxes)
  std::vector<int> ranks;             // the global rank at each mesh coordinate, row-major; or boxes' ranks
  std::vector<Placement> placements;  // one per mesh dim
  std::vector<Box> boxes;             // non-empty: explicit boxes, boxes[i] held by ranks[i]

  bool replicated() const;  // no boxes, and every placement Replicate (or no mesh)
  bool operator==(const Layout& o) const {
    return mesh_shape == o.mesh_shape && ranks == o.ranks && placements == o.placements && boxes == o.boxes;
  }
  std::string Text() const;  // "mesh (2, 2) over ranks [0, 1, 2, 3]: (_StridedShard(dim=0, sf=2), Shard(dim=0))"
  // Throws kInvalidArgument naming `what` when the layout cannot describe a tensor of `shape` (a
  // placement dim outside it, a box outside it).
  void Check(const std::vector<uint64_t>& shape, const std::string& what) const;
  // The same for `key`'s tensor ("key '<key>'"), with the name built only for an error: called once per
  // entry, 90k times at DeepSeek-V3's scale.
  void CheckKey(const std::vector<uint64_t>& shape, const std::string& key) const;
};

// FSDP2's 1-d mesh (Shard(0) over all ranks), or HSDP's (Replicate(), Shard(0)) on (replicas, world /
// replicas) with rank = replica * S + shard, as init_device_mesh lays it out.
Layout DimZeroLayout(int world_size, int replicas = 1);
Layout ReplicatedLayout();

struct Span {
  uint64_t begin = 0, end = 0;  // global indices along one dim
  uint64_t size() const { return end - begin; }
  bool operator==(const Span& o) const { return begin == o.begin && end == o.end; }
};

struct Piece {
  bool held = true;                      // false: the rank is not in the mesh
  std::vector<std::vector<Span>> dims;   // per tensor dim: global spans, in local order
  std::vector<uint64_t> LocalShape() const;
  uint64_t numel() const;
  bool operator==(const Piece& o) const { return held == o.held && dims == o.dims; }
};

// torch.chunk's piece c of n over `length` elements: chunks of ceil(length / n), trailing ones smaller or
// empty. REQUIRES: n > 0.
Span ChunkSpan(uint64_t length, uint64_t n, uint64_t c);

// The rank's piece of a tensor of global `shape`. REQUIRES: layout.Check(shape) passed.
Piece PieceOf(const std::vector<uint64_t>& shape, const Layout& layout, int rank);

// One distinct piece and the ranks that hold it (its replicas), ascending.
struct Holding {
  Piece piece;
  std::vector<int> holders;
};
// Every distinct non-empty piece over a world of `world_size` ranks, in order of its lowest holder.
std::vector<Holding> Holdings(const std::vector<uint64_t>& shape, const Layout& layout, int world_size);

// A box of the global tensor as strided runs: `runs` runs of `count` elements, run i starting at global
// element first + i * stride and landing at local element local_first + i * local_stride (row-major).
struct StridedRuns {
  uint64_t first = 0, count = 0, runs = 1, stride = 0;
  uint64_t local_first = 0, local_stride = 0;
};
// The runs of every box of `piece`, in local order. A box whose inner dims are whole is one run; a
// Shard(1) of a matrix is one StridedRuns of `rows` runs. Calls fn(const StridedRuns&).
template <typename F>
void ForEachRuns(const std::vector<uint64_t>& shape, const Piece& piece, F&& fn);

}  // namespace shardcast

#include "runtime/layout/layout_inl.h"
