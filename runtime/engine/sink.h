// runtime/engine/sink: where the bytes of a stream land on a rank. The stream never branches on the target
// or the mode: it asks its sink for a place to write in place, or hands it the bytes.
//
//   ShardSink      this rank's local shard tensors, one per manifest entry (CPU, pinned or CUDA)
//   ChecksumSink   keeps nothing; hashes what arrives (benchmarks at full scale, dry runs)
//   FileSink       a save's output files, at their final offsets (runtime/engine/file_sink.h)
//
// Thread safety: HostDirect may be called from the reader thread while the stream thread stores
// other segments; the segments of distinct messages never overlap. Store is called by one thread.
// Failure: Store throws shardcast::Error (kIo, kInternal).
#pragma once

#include <ATen/core/Tensor.h>

#include <vector>

#include "runtime/stream/digest.h"
#include "runtime/stream/schedule.h"

namespace shardcast {

class Sink {
 public:
  virtual ~Sink() = default;
  // Host memory where segment s's target bytes may be written in place, or nullptr.
  virtual unsigned char* HostDirect(const Segment& s) = 0;
  // Device memory where a device transport may receive segment s in place, or nullptr.
  virtual unsigned char* DeviceDirect(const Segment& s) { return nullptr; }
  // Segment s's target bytes, in host memory: store them. Not called for bytes written in place.
  virtual void Store(const Segment& s, const unsigned char* data) = 0;
  // Segment s, received in place on the device, as host bytes into `out` (for verify).
  virtual void CopyDeviceToHost(const Segment& s, unsigned char* out) {}
  // Whether anything is kept (false: the checksum sink).
  virtual bool keeps() const { return true; }
};

class ShardSink : public Sink {
 public:
  // The tensors are written in place through detached aliases: a parameter's local shard (a DTensor's
  // to_local(), which requires grad) is a view autograd forbids writing through, on the device path.
  explicit ShardSink(std::vector<at::Tensor> tensors);
  unsigned char* HostDirect(const Segment& s) override;
  unsigned char* DeviceDirect(const Segment& s) override;
  void Store(const Segment& s, const unsigned char* data) override;
  void CopyDeviceToHost(const Segment& s, unsigned char* out) override;

 private:
  at::Tensor Bytes(const Segment& s);
  std::vector<at::Tensor> tensors_;
};

class ChecksumSink : public Sink {
 public:
  explicit ChecksumSink(size_t entries) : column_(entries) {}
  unsigned char* HostDirect(const Segment&) override { return nullptr; }
  void Store(const Segment& s, const unsigned char* data) override {
    column_.Add(s.entry, SegmentDigest(data, s.target_bytes, s.local_offset));
  }
  bool keeps() const override { return false; }
  // What this rank received, as one digest: the same for every source and route (the load report's
  // `digest`, so that checksum-only runs of different sources can be compared).
  uint64_t digest() const { return column_.Fold(); }

 private:
  DigestColumn column_;
};

}  // namespace shardcast
