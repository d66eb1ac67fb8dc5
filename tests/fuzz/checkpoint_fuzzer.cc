// libFuzzer target: Checkpoint::Open on a directory built from the input, then every tensor read.
// Any input must either open and read or throw shardcast::Error; anything else is a bug. What is
// accepted must read back exactly the bytes the input put in the files. Every quantized pair the keys
// name (fp8 and its scale, MXFP4 blocks and scales, an NVFP4 triple) is checked as the loaders check
// it, and a pair that passes has its first row dequantized from the bytes read.
//
// Input layout (lengths little-endian, cut short where the input ends):
//
//   flags:u8 | index_len:u16 | index.json | a_len:u16 | a.safetensors | b.safetensors (the rest)
//
//   flags bit 0: write model.safetensors.index.json (else a.safetensors is model.safetensors)
//         bit 1: write b.safetensors
//         bit 2: ReadMode::kPread (else kMmap)
//         bit 3: c.safetensors is a symlink to a.safetensors, sub/ a symlink to the directory
//         bit 4: open a.safetensors's path itself instead of the directory
//         bit 5: OpenOptions::sequential_hint
#include <limits.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <map>
#include <string>
#include <vector>

#include "allocators/error.h"
#include "loaders/checkpoint.h"
#include "loaders/quant/mxfp4.h"
#include "loaders/quant/nvfp4.h"
#include "loaders/quantization.h"
#include "tests/fuzz/fuzz_util.h"

namespace {

using shardcast::fuzz::ScratchDir;

const ScratchDir& Dir() {
  static const ScratchDir dir("checkpoint_fuzzer", {"model.safetensors.index.json", "model.safetensors",
                                                    "a.safetensors", "b.safetensors", "c.safetensors", "sub"});
  return dir;
}

void Check(bool ok) {
  if (!ok) __builtin_trap();
}

// Where a path really leads (the index may say "./a.safetensors" or "sub/c.safetensors").
std::string Real(const std::string& path) {
  char buf[PATH_MAX];
  return realpath(path.c_str(), buf) ? std::string(buf) : std::string();
}

std::vector<unsigned char> ReadAll(const shardcast::Checkpoint& ckpt, const std::string& key) {
  const shardcast::Checkpoint::Entry& e = ckpt.Get(key);
  std::vector<unsigned char> out(e.info->nbytes());
  e.file->ReadRows(*e.info, 0, e.info->rows(), out.data());
  return out;
}

// The pairing checks of the quantized formats on what the fuzzer named, then one row through the
// kernel. Each may throw shardcast::Error (a pair that does not fit); nothing else may happen.
void Quantized(const shardcast::Checkpoint& ckpt, const std::string& key) {
  using namespace shardcast;
  const TensorQuant q = QuantOf(ckpt, key);
  const Checkpoint::Entry* partner = q.partner.empty() ? nullptr : ckpt.Find(q.partner);
  if (partner == nullptr) return;
  const TensorInfo& t = *ckpt.Get(key).info;
  const TensorInfo& p = *partner->info;
  if (q.role == QuantRole::kMxfp4Blocks) {
    const std::vector<uint64_t> model = Mxfp4ModelShape(t.shape);
    CheckMxfp4Pair(key.substr(0, key.size() - 7), t.dtype, t.shape, p.dtype, p.shape, model, DType::kBF16);
    const uint64_t rows = t.shape[t.shape.size() - 3], cols = t.shape[t.shape.size() - 2] * kMxfp4Group;
    if (rows == 0 || cols == 0) return;
    const std::vector<unsigned char> blocks = ReadAll(ckpt, key), scales = ReadAll(ckpt, q.partner);
    std::vector<uint16_t> out(cols);
    DequantizeMxfp4Transposed(Mxfp4Matrix{blocks.data(), scales.data(), 0, cols}, OutputWindow{{0, cols}, {0, 1}},
                              DType::kBF16, WindowOut{out.data()});
  } else if (q.role == QuantRole::kNvfp4Weight) {
    const std::string base = key.size() > 7 ? key.substr(0, key.size() - 7) : key;
    const Checkpoint::Entry* global = ckpt.Find(base + ".weight_scale_2");
    if (global == nullptr) return;
    CheckNvfp4Triple(key, t.dtype, t.shape, p.dtype, p.shape, global->info->dtype, global->info->shape);
    const uint64_t rows = t.shape[0], cols = t.shape[1] * 2;
    if (rows == 0 || cols == 0) return;
    const std::vector<unsigned char> values = ReadAll(ckpt, key), scales = ReadAll(ckpt, q.partner);
    const std::vector<unsigned char> g = ReadAll(ckpt, base + ".weight_scale_2");
    float gs;
    std::memcpy(&gs, g.data(), 4);
    std::vector<uint16_t> out(cols);
    DequantizeNvfp4(Nvfp4Matrix{values.data(), scales.data(), gs, 0, cols}, OutputWindow{{0, 1}, {0, cols}},
                    DType::kBF16, WindowOut{out.data()});
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace shardcast;
  const unsigned char* p = data;
  const unsigned char* end = data + size;
  const unsigned flags = p < end ? *p++ : 0;
  std::string_view index = fuzz::Take(p, end, fuzz::TakeLength16(p, end));
  std::string_view a = fuzz::Take(p, end, fuzz::TakeLength16(p, end));
  std::string_view b = fuzz::Take(p, end, static_cast<size_t>(end - p));

  const ScratchDir& dir = Dir();
  dir.Clear();
  std::map<std::string, std::string_view> content;  // real path -> the bytes written there
  const std::string a_name = flags & 1 ? "a.safetensors" : "model.safetensors";
  fuzz::WriteWholeFile(dir / a_name, a);
  content[Real(dir / a_name)] = a;
  if (flags & 1) {
    fuzz::WriteWholeFile(dir / "model.safetensors.index.json", index);
    content[Real(dir / "model.safetensors.index.json")] = index;
  }
  if (flags & 2) {
    fuzz::WriteWholeFile(dir / "b.safetensors", b);
    content[Real(dir / "b.safetensors")] = b;
  }
  if (flags & 8) {
    if (symlink(a_name.c_str(), (dir / "c.safetensors").c_str()) != 0) fuzz::Die("cannot symlink in", dir.path());
    if (symlink(".", (dir / "sub").c_str()) != 0) fuzz::Die("cannot symlink in", dir.path());
  }
  const std::string open_path = flags & 16 ? dir / a_name : dir.path();
  const OpenOptions options{flags & 4 ? ReadMode::kPread : ReadMode::kMmap, (flags & 32) != 0};

  try {
    auto ckpt = Checkpoint::Open(open_path, options);
    std::vector<unsigned char> buf;
    for (const std::string& key : ckpt->keys()) {
      const Checkpoint::Entry& e = ckpt->Get(key);
      const SafetensorsFile& f = *e.file;
      const TensorInfo& t = *e.info;
      auto it = content.find(Real(f.path()));
      Check(it != content.end());
      const std::string_view bytes = it->second;
      Check(f.file_size() == bytes.size());
      Check(f.Find(key) == &t);
      // Accepted means in bounds: the tensor lies inside the file.
      const uint64_t begin = f.header().data_offset() + t.begin;
      Check(t.begin <= t.end && begin + t.nbytes() <= bytes.size());
      buf.assign(t.nbytes(), 0);
      f.ReadRows(t, 0, t.rows(), buf.data());
      Check(t.nbytes() == 0 || std::memcmp(buf.data(), bytes.data() + begin, t.nbytes()) == 0);
      if (f.mode() == ReadMode::kMmap) {
        ByteSpan v = f.View(t);
        Check(v.size == t.nbytes() && (v.size == 0 || std::memcmp(v.data, buf.data(), v.size) == 0));
      }
      f.ReleasePages(begin, t.nbytes());
    }
    for (const std::string& key : ckpt->keys()) {
      try {
        Quantized(*ckpt, key);
      } catch (const Error&) {
      }
    }
    (void)ckpt->total_bytes();
  } catch (const Error&) {
  }
  return 0;
}
