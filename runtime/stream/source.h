// runtime/stream/source: where a reader's bytes come from (SegmentSource). The staging ring asks its source for each
// segment's target bytes; a load reads checkpoint files, a save reads this rank's own shards.
//
//   FileSource    the manifest's files as this rank opened them: copies a part's elements out of the
//                 mapping, or converts them (dtype; fp8 rows with their block scales, dequantized in
//                 the reader, so receivers never see fp8), releasing consumed pages
//   ShardSource   this rank's local tensors (save): runtime/engine/shard_source.h, the one libtorch source
//
// Thread safety: Read and Prefetch are called by the ring's reader threads, several at once (each on its
// own segments): a source keeps no per-call state of its own (FileSource's scratch is per thread).
// Failure: Read throws shardcast::Error (kCheckpoint for a truncated or changed file).
#pragma once

#include <memory>
#include <vector>

#include "loaders/safetensors_file.h"
#include "runtime/stream/schedule.h"

namespace shardcast {

class SegmentSource {
 public:
  virtual ~SegmentSource() = default;
  // Writes segment s's target bytes at `out`.
  virtual void Read(const Segment& s, unsigned char* out) = 0;
  // Asks for segments that will be read soon (read-ahead); best effort.
  virtual void Prefetch(const Segment& s) {}
};

// Owns (shares) the manifest and the file table it reads, so that a reader the staging ring left behind
// in a hung read (staging_ring.h) returns into memory that is still there. The files' pointees must live
// as long as `files` does: an aliasing pointer into the object that owns the checkpoint (the handshake's
// Agreement) gives both one lifetime.
class FileSource : public SegmentSource {
 public:
  FileSource(std::shared_ptr<const Manifest> m, std::shared_ptr<const FileTable> files, bool release_pages)
      : m_owner_(std::move(m)), files_owner_(std::move(files)), m_(*m_owner_), files_(*files_owner_),
        release_(release_pages) {}
  void Read(const Segment& s, unsigned char* out) override;
  void Prefetch(const Segment& s) override;

 private:
  // Elements [first, first + count) of a part, converted to the entry's dtype, at `out`.
  void ReadRun(const ManifestEntry& e, const ManifestPart& p, uint64_t first, uint64_t count, bool release,
               unsigned char* out);

  const std::shared_ptr<const Manifest> m_owner_;
  const std::shared_ptr<const FileTable> files_owner_;
  const Manifest& m_;
  const FileTable& files_;
  bool release_;
};

}  // namespace shardcast
