// libFuzzer target: the row-range read path (ReadRows, RowRange, ReadBytes, RowOffset, ReleasePages)
// at input-chosen ranges, on a valid file built from the input, in both read modes. Every call must
// either succeed with exactly the file's bytes or throw shardcast::Error; and it must succeed
// exactly when the range is inside the tensor or file. A call that reads out of bounds is caught
// by ASan or by the comparison; one that throws on a good range, or returns on a bad one, traps.
#include <fuzzer/FuzzedDataProvider.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "allocators/error.h"
#include "loaders/safetensors_file.h"
#include "loaders/writer.h"
#include "tests/fuzz/fuzz_util.h"

namespace {

using namespace shardcast;

void Check(bool ok) {
  if (!ok) __builtin_trap();
}

const fuzz::ScratchDir& Dir() {
  static const fuzz::ScratchDir dir("read_fuzzer", {"r.safetensors"});
  return dir;
}

// A row bound: mostly near the tensor's rows, sometimes anything at all (overflow probes).
uint64_t Bound(FuzzedDataProvider& in, uint64_t rows) {
  return in.ConsumeBool() ? in.ConsumeIntegralInRange<uint64_t>(0, rows + 2) : in.ConsumeIntegral<uint64_t>();
}

// Runs op and checks it threw shardcast::Error exactly when `valid` is false.
template <typename Op>
void Expect(bool valid, Op op) {
  bool threw = false;
  try {
    op();
  } catch (const Error&) {
    threw = true;
  }
  Check(threw != valid);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  FuzzedDataProvider in(data, size);
  static const DType kTypes[] = {DType::kU8, DType::kBF16, DType::kF32, DType::kF64};
  std::vector<WriteEntry> entries;
  const int n_tensors = in.ConsumeIntegralInRange(1, 3);
  for (int i = 0; i < n_tensors; ++i) {
    WriteEntry e{"t" + std::to_string(i), kTypes[in.ConsumeIntegralInRange(0, 3)], {}};
    const int dims = in.ConsumeIntegralInRange(0, 3);
    for (int d = 0; d < dims; ++d) e.shape.push_back(in.ConsumeIntegralInRange<uint64_t>(0, d == 0 ? 40 : 5));
    entries.push_back(e);
  }
  std::string image = BuildHeader(entries, {});
  for (const WriteEntry& e : entries) {
    std::string bytes = in.ConsumeBytesAsString(e.nbytes());
    bytes.resize(e.nbytes(), '\x5a');
    image += bytes;
  }
  const std::string path = Dir() / "r.safetensors";
  fuzz::WriteWholeFile(path, image);
  const ReadMode mode = in.ConsumeBool() ? ReadMode::kMmap : ReadMode::kPread;
  std::unique_ptr<SafetensorsFile> f;
  try {
    f = SafetensorsFile::Open(path, OpenOptions{mode, in.ConsumeBool()});
  } catch (const Error&) {
    __builtin_trap();  // BuildHeader's files are valid
  }
  const uint64_t size_bytes = f->file_size();
  Check(size_bytes == image.size());
  std::vector<unsigned char> buf;
  while (in.remaining_bytes() > 0) {
    const TensorInfo& t = f->header().tensors[in.ConsumeIntegralInRange<size_t>(0, entries.size() - 1)];
    const uint64_t rows = t.rows();
    switch (in.ConsumeIntegralInRange(0, 4)) {
      case 0: {  // ReadRows
        const uint64_t r0 = Bound(in, rows), r1 = Bound(in, rows);
        const bool valid = r0 <= r1 && r1 <= rows;
        buf.assign(valid ? (r1 - r0) * t.row_bytes() : 1, 0);
        Expect(valid, [&] { f->ReadRows(t, r0, r1, buf.data()); });
        if (valid) {
          const uint64_t off = f->header().data_offset() + t.begin + r0 * t.row_bytes();
          Check(buf.empty() || std::memcmp(buf.data(), image.data() + off, buf.size()) == 0);
        }
        break;
      }
      case 1: {  // RowRange: zero-copy, mmap only
        const uint64_t r0 = Bound(in, rows), r1 = Bound(in, rows);
        const bool valid = r0 <= r1 && r1 <= rows && mode == ReadMode::kMmap;
        ByteSpan v;
        Expect(valid, [&] { v = f->RowRange(t, r0, r1); });
        if (valid) {
          const uint64_t off = f->header().data_offset() + t.begin + r0 * t.row_bytes();
          Check(v.size == (r1 - r0) * t.row_bytes());
          Check(v.size == 0 || std::memcmp(v.data, image.data() + off, v.size) == 0);
        }
        break;
      }
      case 2: {  // ReadBytes at any file range
        const uint64_t offset = Bound(in, size_bytes), n = Bound(in, size_bytes);
        const bool valid = offset <= size_bytes && n <= size_bytes - offset;
        buf.assign(valid ? n : 1, 0);
        Expect(valid, [&] { f->ReadBytes(offset, n, buf.data(), "fuzz bytes"); });
        if (valid) Check(n == 0 || std::memcmp(buf.data(), image.data() + offset, n) == 0);
        break;
      }
      case 3: {  // RowOffset and RowRangeBytes agree with the layout
        const uint64_t r0 = Bound(in, rows), r1 = Bound(in, rows);
        const bool valid = r0 <= r1 && r1 <= rows;
        Expect(valid, [&] {
          Check(f->RowOffset(t, r0) == f->header().data_offset() + t.begin + r0 * t.row_bytes());
          Check(f->RowRangeBytes(t, r0, r1) == (r1 - r0) * t.row_bytes());
        });
        break;
      }
      case 4: {  // ReleasePages: later reads must still see the file's bytes
        const uint64_t offset = Bound(in, size_bytes), n = Bound(in, size_bytes);
        const bool valid = offset <= size_bytes && n <= size_bytes - offset;
        const Release how = in.ConsumeBool() ? Release::kMapping : Release::kMappingAndCache;
        Expect(valid, [&] { f->ReleasePages(offset, n, how); });
        break;
      }
    }
  }
  return 0;
}
