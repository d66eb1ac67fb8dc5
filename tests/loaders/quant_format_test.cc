// The quantized-format registry (loaders/quant/format.h) on real safetensors files: which format claims
// each key, the shapes it answers, and reads that give the kernel's bytes for any split of a tensor.
#include "loaders/quant/format.h"

#include <gtest/gtest.h>

#include <cstring>

#include "loaders/checkpoint.h"
#include "loaders/quant/mxfp4.h"
#include "loaders/quant/nvfp4.h"
#include "loaders/quantization.h"
#include "loaders/shape.h"
#include "loaders/synth.h"
#include "loaders/writer.h"
#include "test_util.h"

namespace shardcast {
namespace {

using testing::TempDir;

// A checkpoint with every format, complete and not, beside a plain tensor. Values are synthetic.
std::unique_ptr<Checkpoint> WriteMixed(const TempDir& dir) {
  const std::vector<WriteEntry> entries = {
      {"plain.weight", DType::kBF16, {4, 8}},
      {"fp8.weight", DType::kF8_E4M3, {160, 200}},           // block 128: grid [2, 2]
      {"fp8.weight_scale_inv", DType::kF32, {2, 2}},
      {"orphan_fp8.weight", DType::kF8_E5M2, {4, 4}},        // no scale: claimed, not complete
      {"experts.gate_up_proj_blocks", DType::kU8, {3, 10, 2, 16}},  // [E, out, in / 32, 16]
      {"experts.gate_up_proj_scales", DType::kF8_E8M0, {3, 10, 2}},
      {"experts.down_proj_blocks", DType::kU8, {2, 4, 1, 16}},  // no scales
      {"nv.weight", DType::kU8, {6, 24}},                    // [out, in / 2]: in = 48
      {"nv.weight_scale", DType::kF8_E4M3, {6, 3}},
      {"nv.weight_scale_2", DType::kF32, {}},
      {"nv.input_scale", DType::kF32, {}},
      {"half.weight", DType::kU8, {2, 8}},                   // NVFP4 without its block scale
      {"half.weight_scale_2", DType::kF32, {}},
      {"enc.pos_blocks", DType::kBF16, {4, 8}},              // a float tensor that only ends in _blocks
  };
  WriteCheckpoint(dir.path(), entries, [](const WriteEntry& e, uint64_t offset, unsigned char* out, size_t n) {
    const size_t es = DTypeSize(e.dtype);
    SynthElements(7, e.key, e.dtype, offset / es, n / es, out);
  });
  return Checkpoint::Open(dir.path());
}

struct Expected {
  const char* key;
  const char* format;  // "" for none
  QuantPiece piece;
  bool complete;
  const char* partner;
  const char* model_key;
};

TEST(QuantFormat, EachKeyBelongsToOneFormatAsOnePiece) {
  TempDir dir;
  auto ckpt = WriteMixed(dir);
  const Expected want[] = {
      {"plain.weight", "", QuantPiece::kNone, false, "", ""},
      {"fp8.weight", "fp8", QuantPiece::kData, true, "fp8.weight_scale_inv", "fp8.weight"},
      {"fp8.weight_scale_inv", "fp8", QuantPiece::kScale, true, "fp8.weight", "fp8.weight"},
      {"orphan_fp8.weight", "fp8", QuantPiece::kData, false, "orphan_fp8.weight_scale_inv", "orphan_fp8.weight"},
      {"experts.gate_up_proj_blocks", "mxfp4", QuantPiece::kData, true, "experts.gate_up_proj_scales",
       "experts.gate_up_proj"},
      // F8_E8M0 is an fp8 dtype: the fp8 entry claims it, but MXFP4's complete pairing wins.
      {"experts.gate_up_proj_scales", "mxfp4", QuantPiece::kScale, true, "experts.gate_up_proj_blocks",
       "experts.gate_up_proj"},
      {"experts.down_proj_blocks", "mxfp4", QuantPiece::kData, false, "experts.down_proj_scales",
       "experts.down_proj"},
      {"nv.weight", "nvfp4", QuantPiece::kData, true, "nv.weight_scale", "nv.weight"},
      {"nv.weight_scale", "nvfp4", QuantPiece::kScale, true, "nv.weight", "nv.weight"},
      {"nv.weight_scale_2", "nvfp4", QuantPiece::kScale, true, "nv.weight", "nv.weight"},
      {"nv.input_scale", "nvfp4", QuantPiece::kSidecar, false, "nv.weight", "nv.weight"},
      {"half.weight", "nvfp4", QuantPiece::kData, false, "half.weight_scale", "half.weight"},
      {"half.weight_scale_2", "nvfp4", QuantPiece::kScale, true, "half.weight", "half.weight"},
      // Regression (review): MXFP4 claimed any *_blocks, so convert refused to copy this one.
      {"enc.pos_blocks", "", QuantPiece::kNone, false, "", ""},
  };
  const FindStored find = FindIn(*ckpt);
  for (const Expected& w : want) {
    const QuantMatch m = DetectQuant(find, w.key);
    EXPECT_EQ(m.format ? m.format->name : "", w.format) << w.key;
    EXPECT_EQ(m.piece, w.piece) << w.key;
    if (m.piece == QuantPiece::kNone) continue;
    EXPECT_EQ(m.complete, w.complete) << w.key;
    EXPECT_EQ(m.partner, w.partner) << w.key;
    EXPECT_EQ(m.model_key, w.model_key) << w.key;
  }
  EXPECT_EQ(DetectQuant(find, "no.such.key").piece, QuantPiece::kNone);
}

// inspect names complete pairings only, as it always did; the roles come from the registry.
TEST(QuantFormat, QuantOfNamesCompletePairingsOnly) {
  TempDir dir;
  auto ckpt = WriteMixed(dir);
  EXPECT_EQ(QuantOf(*ckpt, "fp8.weight").role, QuantRole::kFp8Weight);
  EXPECT_EQ(QuantOf(*ckpt, "orphan_fp8.weight").role, QuantRole::kNone);
  EXPECT_EQ(QuantOf(*ckpt, "experts.gate_up_proj_scales").role, QuantRole::kMxfp4Scales);
  EXPECT_EQ(QuantOf(*ckpt, "experts.down_proj_blocks").role, QuantRole::kNone);
  EXPECT_EQ(QuantOf(*ckpt, "nv.weight_scale_2").role, QuantRole::kNvfp4Scale);
  EXPECT_EQ(QuantOf(*ckpt, "nv.input_scale").role, QuantRole::kNone);
  EXPECT_EQ(QuantOf(*ckpt, "half.weight").role, QuantRole::kNone);
  EXPECT_EQ(QuantRoleName(QuantRole::kMxfp4Scales), "mxfp4 scales");
  EXPECT_EQ(QuantRoleName(QuantRole::kNvfp4Weight), "nvfp4");
  EXPECT_EQ(QuantRoleName(QuantRole::kNone), "");
}

TEST(QuantFormat, ShapesFromTheStoredShape) {
  EXPECT_EQ(kMxfp4Format.model_shape({3, 10, 2, 16}), (std::vector<uint64_t>{3, 64, 10}));
  EXPECT_EQ(kMxfp4Format.kept_shape({3, 10, 2, 16}), (std::vector<uint64_t>{3, 10, 32}));
  EXPECT_EQ(kMxfp4Format.model_shape({3, 10, 4, 8}), (std::vector<uint64_t>{3, 128, 10}));  // bind names it
  EXPECT_TRUE(kMxfp4Format.model_shape({10, 16}).empty());
  EXPECT_EQ(kNvfp4Format.model_shape({6, 24}), (std::vector<uint64_t>{6, 48}));
  EXPECT_TRUE(kNvfp4Format.model_shape({6, 24, 1}).empty());
  EXPECT_EQ(kFp8Format.model_shape({160, 200}), (std::vector<uint64_t>{160, 200}));
  EXPECT_EQ(kMxfp4Format.stored_key("x.experts"), "x.experts_blocks");
  EXPECT_EQ(kNvfp4Format.stored_key("x.weight"), "");
  EXPECT_EQ(kNvfp4Format.consumed("m.weight"),
            (std::vector<std::string>{"m.weight_scale", "m.weight_scale_2", "m.input_scale"}));
  ASSERT_EQ(QuantFormats().size(), 3u);
  EXPECT_EQ(QuantFormatOfPacking(1), &kMxfp4Format);
  EXPECT_EQ(QuantFormatOfPacking(2), &kNvfp4Format);
  EXPECT_EQ(QuantFormatOfPacking(0), &kFp8Format);  // the plain layout, when a part dequantizes
  EXPECT_EQ(QuantFormatOfPacking(3), nullptr);
  EXPECT_EQ(QuantFormatNamed("fp8"), &kFp8Format);
}

std::vector<unsigned char> Bytes(const Checkpoint& ckpt, const std::string& key) {
  const Checkpoint::Entry& e = ckpt.Get(key);
  std::vector<unsigned char> out(e.info->nbytes());
  e.file->ReadBytes(e.file->header().data_offset() + e.info->begin, out.size(), out.data(), key);
  return out;
}

// The whole model tensor as the kernel gives it from the stored bytes, independently of the entry.
std::vector<unsigned char> KernelOutput(const Checkpoint& ckpt, const QuantFormat& f, const PackedTensor& t,
                                        DType target) {
  const uint64_t ts = DTypeSize(target);
  std::vector<unsigned char> out(Numel(t.shape) * ts);
  const std::vector<unsigned char> data = Bytes(ckpt, t.data_key), scale = Bytes(ckpt, t.scale_key);
  if (&f == &kFp8Format) {
    Dequantize(DequantSource{t.data_dtype, data.data()}, DequantScale{t.scale_dtype, scale.data(), t.grid_cols},
               {0, t.shape[0]}, t.shape[1], t.block, target, out.data());
  } else if (&f == &kMxfp4Format) {
    const uint64_t in = t.shape[1], o = t.shape[2], per = in * o;
    for (uint64_t e = 0; e < t.shape[0]; ++e) {
      const Mxfp4Matrix m{data.data() + e * per / 2, scale.data() + e * o * (in / kMxfp4Group), 0, in};
      DequantizeMxfp4Transposed(m, OutputWindow{{0, in}, {0, o}}, target, WindowOut{out.data() + e * per * ts});
    }
  } else {
    float global;
    std::memcpy(&global, &t.global_bits, 4);
    const Nvfp4Matrix m{data.data(), scale.data(), global, 0, t.shape[1]};
    DequantizeNvfp4(m, OutputWindow{{0, t.shape[0]}, {0, t.shape[1]}}, target, WindowOut{out.data()});
  }
  return out;
}

// Every format's read gives the kernel's bytes, whole and in pieces that cut rows, blocks and experts.
TEST(QuantFormat, ReadsAreTheKernelsBytesForAnySplit) {
  TempDir dir;
  auto ckpt = WriteMixed(dir);
  std::vector<unsigned char> scratch;
  const ScratchFn get = [&scratch](uint64_t n) {
    scratch.resize(n);
    return scratch.data();
  };
  for (const char* key : {"fp8.weight", "experts.gate_up_proj_blocks", "nv.weight"}) {
    for (DType target : {DType::kBF16, DType::kF16, DType::kF32}) {
      const QuantMatch m = DetectQuant(FindIn(*ckpt), key);
      ASSERT_NE(m.format, nullptr) << key;
      BindRequest r;
      r.context = std::string("test '") + key + "'";
      r.target = target;
      const PackedTensor t = m.format->bind(*ckpt, key, r);
      const std::vector<unsigned char> want = KernelOutput(*ckpt, *m.format, t, target);
      const uint64_t n = Numel(t.shape), ts = DTypeSize(target);
      ASSERT_EQ(m.format->source_bytes(t) > 0, true);
      for (uint64_t piece : {n, uint64_t{7}, uint64_t{33}, uint64_t{200}, n / 3 + 1}) {
        std::vector<unsigned char> got(n * ts, 0xAB);
        for (uint64_t at = 0; at < n; at += piece) {
          const uint64_t count = std::min(piece, n - at);
          m.format->prefetch(t, at, count);
          m.format->read(t, ReadRequest{at, count, target, /*release=*/at % 2 == 0}, get, got.data() + at * ts);
        }
        ASSERT_EQ(got, want) << key << " as " << DTypeName(target) << " in pieces of " << piece;
      }
    }
  }
}

// A claim whose partners are missing is an error naming the context and the missing key, never a read.
TEST(QuantFormat, BindNamesWhatIsMissing) {
  TempDir dir;
  auto ckpt = WriteMixed(dir);
  const std::pair<const char*, const char*> cases[] = {
      {"orphan_fp8.weight", "orphan_fp8.weight_scale_inv"},
      {"experts.down_proj_blocks", "experts.down_proj_scales"},
      {"half.weight", "half.weight_scale"},
  };
  for (const auto& [key, missing] : cases) {
    const QuantMatch m = DetectQuant(FindIn(*ckpt), key);
    BindRequest r;
    r.context = "key 'the model's'";
    try {
      m.format->bind(*ckpt, key, r);
      ADD_FAILURE() << key << " bound without " << missing;
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::kCheckpoint) << e.what();
      EXPECT_NE(std::string(e.what()).find("key 'the model's'"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find(missing), std::string::npos) << e.what();
    }
  }
}

}  // namespace
}  // namespace shardcast
