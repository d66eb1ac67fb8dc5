// loaders/shape: a tensor shape as the error messages name it, and its element count. One place for
// both, so that every message prints a shape the same way ("[2, 3]"; "[]" for a scalar).
// Thread-safe: pure functions.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace shardcast {

std::string ShapeText(const std::vector<uint64_t>& shape);
// The product of the dims (1 for a scalar), wrapping on overflow: callers that may overflow check first.
uint64_t Numel(const std::vector<uint64_t>& shape);

// A shape held once by a table that outlives the view (Manifest::KeepShape): a pointer where a model's
// 90k entries of a few dozen distinct shapes would each hold a std::vector (56 B with its heap block).
// Reads as the const std::vector it views, so functions of a shape take it as one. A default one is the
// scalar shape []. Copying copies the pointer; the shape never changes.
class ShapeView {
 public:
  ShapeView() = default;
  explicit ShapeView(const std::vector<uint64_t>* held) : held_(held) {}

  operator const std::vector<uint64_t>&() const { return *held_; }  // NOLINT: reads as the vector
  const std::vector<uint64_t>& dims() const { return *held_; }
  size_t size() const { return held_->size(); }
  bool empty() const { return held_->empty(); }
  uint64_t operator[](size_t i) const { return (*held_)[i]; }
  uint64_t front() const { return held_->front(); }
  uint64_t back() const { return held_->back(); }
  std::vector<uint64_t>::const_iterator begin() const { return held_->begin(); }
  std::vector<uint64_t>::const_iterator end() const { return held_->end(); }

  friend bool operator==(const ShapeView& a, const ShapeView& b) { return a.dims() == b.dims(); }
  friend bool operator==(const ShapeView& a, const std::vector<uint64_t>& b) { return a.dims() == b; }
  friend bool operator==(const std::vector<uint64_t>& a, const ShapeView& b) { return a == b.dims(); }
  friend bool operator!=(const ShapeView& a, const ShapeView& b) { return !(a == b); }
  friend bool operator!=(const ShapeView& a, const std::vector<uint64_t>& b) { return !(a == b); }
  friend bool operator!=(const std::vector<uint64_t>& a, const ShapeView& b) { return !(a == b); }

 private:
  static const std::vector<uint64_t> kScalar;
  const std::vector<uint64_t>* held_ = &kScalar;
};

}  // namespace shardcast
