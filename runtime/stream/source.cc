#include "runtime/stream/source.h"

#include <algorithm>
#include <cstring>
#include <string>

#include "allocators/error.h"
#include "allocators/scratch_buffer.h"
#include "runtime/manifest/quant_parts.h"

namespace shardcast {
namespace {

constexpr uint64_t kReleaseStep = 8ull << 20;

// Conversion scratch (raw bytes before a dtype conversion, a dequantizing format's step): one per thread,
// since the ring's readers call Read at once. It lives as long as the reader thread.
ScratchBuffer& Scratch() {
  thread_local ScratchBuffer scratch;
  return scratch;
}

}  // namespace

void FileSource::Read(const Segment& s, unsigned char* out) {
  const ManifestEntry& e = m_.entries[s.entry];
  const ManifestPart& p = e.parts[s.part];
  if (s.source_contiguous()) {
    ReadRun(e, p, s.first, s.runs * s.count, release_, out);
    return;
  }
  // A strided window (one run per row of a Shard(1) piece, say): the runs, then the span released once.
  const uint64_t ts = DTypeSize(e.target_dtype), ss = DTypeSize(p.source_dtype);
  for (uint64_t i = 0; i < s.runs; ++i) ReadRun(e, p, s.first + i * s.stride, s.count, false, out + i * s.count * ts);
  if (release_ && p.packing == Packing::kNone) {  // a packed part releases its own bytes
    const uint64_t span = ((s.runs - 1) * s.stride + s.count) * ss;
    files_[p.file]->ReleasePages(s.source_offset, span);
  }
}

void FileSource::ReadRun(const ManifestEntry& e, const ManifestPart& p, uint64_t first, uint64_t count, bool release,
                         unsigned char* out) {
  if (p.dequantize) {  // by its format's read, one step of stored bytes and scales in scratch at a time
    const ReadRequest r{first, count, e.target_dtype, release};
    return FormatOf(p).read(PackedOf(p, &files_), r, [](uint64_t n) { return Scratch().Get(n); }, out);
  }
  const uint64_t ss = DTypeSize(p.source_dtype), ts = DTypeSize(e.target_dtype);
  const SafetensorsFile& f = *files_[p.file];
  const std::string what = "tensor '" + std::string(p.checkpoint_key) + "'";
  // In steps of kReleaseStep, each released as soon as it is copied: the file pages mapped at once
  // stay a few MiB, not a whole chunk.
  const uint64_t offset = p.offset + first * ss, bytes = count * ss;
  const uint64_t step = std::max<uint64_t>(ss, kReleaseStep / ss * ss);
  for (uint64_t done = 0; done < bytes; done += step) {
    const uint64_t n = std::min(step, bytes - done);
    unsigned char* dst = out + done / ss * ts;
    if (p.source_dtype == e.target_dtype) {
      f.ReadBytes(offset + done, n, dst, what);
    } else {
      unsigned char* raw = Scratch().Get(n);
      f.ReadBytes(offset + done, n, raw, what);
      ConvertElements(p.source_dtype, e.target_dtype, raw, dst, n / ss);
    }
    if (release) f.ReleasePages(offset + done, n);
  }
}

void FileSource::Prefetch(const Segment& s) {
  const ManifestPart& p = m_.entries[s.entry].parts[s.part];
  const uint64_t last = (s.runs - 1) * s.stride + s.count;  // elements from `first` to the end of the last run
  if (p.dequantize) return FormatOf(p).prefetch(PackedOf(p, &files_), s.first, last);
  files_[p.file]->Prefetch(s.source_offset, last * DTypeSize(p.source_dtype));
}

}  // namespace shardcast
