// runtime/manifest/manifest: everything that shapes a load's stream, decided by rank 0 and agreed by every
// rank before any data moves.
//
//   StreamParams   chunk, coalescing, staging, source, verify, strict keys: the reader's values
//   files          by name (relative to the checkpoint), size and header digest
//   layouts        rank 0's layout table (runtime/layout/layout.h): each entry's mesh and placements
//   entries        key, target dtype, global shape, role, layout, and the checkpoint parts that
//                  supply its elements (key, dtype, file, offset, element count, shape)
//
// Resolve (rank 0): every plan entry that comes from the checkpoint (parameters, sidecars, persistent
// buffers) is looked up by key, through the declared mappings (prefix add/strip, tied weights,
// composed experts). Keys the model does not own are skipped and counted, or rejected when
// strict_keys; either way they never shift anything, because nothing is paired by position.
//
// Check (every rank): same world size, keys, shapes, dtypes, roles and layouts as its own plan; the options
// that change results (verify, strict_keys) equal its own. The first difference is the rank's
// problem for the verdict. Everything else in StreamParams is adopted from rank 0.
//
// Wire format: EncodeManifest / DecodeManifest, one versioned pair (manifest_wire.cc).
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <memory_resource>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include "loaders/checkpoint.h"
#include "loaders/shape.h"
#include "runtime/layout/plan.h"
#include "runtime/load_options.h"
#include "runtime/manifest/key_mapping.h"

namespace shardcast {

// The reader's options that shape the stream. Every rank runs with these, whatever it asked for.
struct StreamParams {
  Source source = Source::kRank0;        // decided: never kAuto in a manifest (ChooseSource)
  std::string source_reason;             // why: "asked for" or what ChooseSource saw
  uint64_t chunk_bytes = 64ull << 20;    // message size (a part row larger than this is one message)
  uint64_t coalesce_bytes = 4ull << 20;  // small segments to one rank are packed up to this
  uint32_t staging_slots = 4;
  bool verify = false;       // must equal every rank's own
  bool strict_keys = false;  // must equal every rank's own
};
StreamParams StreamParamsFrom(const LoadOptions& options);

// The manifest's files as this rank opened them, by manifest file index (agreed by name, size, header
// digest and data samples in the handshake): what a part's `file` indexes on a reading rank.
using FileTable = std::vector<const SafetensorsFile*>;

struct ManifestFile {
  std::string name;        // relative to the checkpoint directory (the file name for a single file)
  uint64_t size = 0;       // bytes, as fstat saw them
  uint64_t digest = 0;     // of the header (see FileDigest)
  uint64_t sample = 0;     // of samples of its data (SafetensorsFile::SampleDigest); 0 where not taken
};

// The block scales of an fp8 part, read beside its rows and applied by the reader (loaders/quant/dequant.h):
// rows [r0, r1) of the part need scale rows [r0 / block.rows, ceil(r1 / block.rows)).
struct ManifestScale {
  std::string key;                  // "<weight key>_scale_inv"
  DType dtype = DType::kF32;        // F32, BF16, F16, F8_E8M0 or U8 (E8M0 bytes)
  uint32_t file = 0;                // index into Manifest::files
  uint64_t offset = 0;              // absolute byte offset of the scale grid in that file
  uint64_t grid_rows = 0, grid_cols = 0;
  BlockSize block;
  uint32_t global_bits = 0;         // NVFP4 only: the F32 bits of "<m>.weight_scale_2", read by rank 0
};

// How a part's checkpoint bytes are laid out, when not as the entry's elements (runtime/manifest/quant_parts.h).
enum class Packing : uint8_t {
  kNone = 0,   // source_dtype elements in the entry's order (fp8 rows with block scales included)
  kMxfp4 = 1,  // an MXFP4 pair: checkpoint_key is "<key>_blocks" [..., out, in / 32, 16] at `offset`,
               // `scale` its "<key>_scales" [..., out, in / 32] (grid rows = ... x out, cols = in / 32);
               // numel and shape are the entry's (the transpose, [..., in, out]); dequantize is true
  kNvfp4 = 2,  // a ModelOpt NVFP4 weight: checkpoint_key is "<m>.weight" U8 [out, in / 2] at `offset`,
               // `scale` its "<m>.weight_scale" F8_E4M3 [out, in / 16] (block 1 x 16) with global_bits
               // its "<m>.weight_scale_2"; numel and shape are the model's [out, in]; dequantize is true
};

// One checkpoint tensor that supplies consecutive elements of an entry.
//
// The keys and shapes of parts and entries are views of what their Manifest holds (Manifest::Keep,
// KeepShape), one copy of each key and one of each distinct shape: 90k entries at DeepSeek-V3's scale,
// where a std::string and a std::vector per field were two thirds of the manifest. A part or entry
// built outside a manifest views keys that outlive it (literals, or a Keep) and kept shapes.
struct ManifestPart {
  std::string_view checkpoint_key;
  DType source_dtype = DType::kBF16;  // in the checkpoint (U8 E8M0 exponent bytes for an F8_E8M0 entry: F8_E8M0)
  bool dequantize = false;            // fp8 with block scales, to the entry's floating dtype
  Packing packing = Packing::kNone;
  uint32_t file = 0;                  // index into Manifest::files
  uint64_t offset = 0;                // absolute byte offset of its data in that file
  uint64_t numel = 0;
  ShapeView shape;                    // the checkpoint tensor's own shape
  // When dequantize, else null: one the manifest holds (Manifest::KeepScale). Out of line because most
  // parts have none (a part of 56 B fits glibc's 64-byte block where 64 B took 80).
  const ManifestScale* scale = nullptr;
  uint64_t row_elems() const;         // elements of one dim-0 row of the part (1 for 0-dim and 1-d)
};

struct ManifestEntry {
  std::string_view key;               // the model's key
  DType target_dtype = DType::kBF16;  // rank 0's plan
  ShapeView shape;
  Role role = Role::kParameter;
  uint32_t layout = 0;                // index into Manifest::layouts
  std::vector<ManifestPart> parts;    // one, or several concatenated (KeyMapping::compose)
};

struct Manifest {
  int world_size = 1;  // every rank of the communicator
  StreamParams params;
  std::vector<Layout> layouts;  // rank 0's plan's layout table
  const Layout& LayoutOf(const ManifestEntry& e) const { return layouts[e.layout]; }
  std::string MeshText() const;  // the meshes the entries use, for the report
  std::vector<ManifestFile> files;
  std::vector<ManifestEntry> entries;
  uint64_t skipped = 0;                       // checkpoint keys the model does not own
  std::vector<std::string> skipped_examples;  // up to 5

  // Copies `text` into storage this manifest owns and returns a view of the copy, valid while the
  // manifest or any copy of it lives (copies share the storage, which only grows): what the entries'
  // and parts' keys view. Not thread-safe: one thread builds a manifest (and its copies' keys).
  std::string_view Keep(std::string_view text);
  // The same for a shape: one copy of each distinct shape, however many entries have it.
  ShapeView KeepShape(const std::vector<uint64_t>& shape);
  // The same for a part's scale (ManifestPart::scale).
  const ManifestScale* KeepScale(ManifestScale scale);

 private:
  struct Held;
  Held& held();
  std::shared_ptr<Held> held_;
};

std::string EncodeManifest(const Manifest& m);
Manifest DecodeManifest(const std::string& bytes);  // throws kComm on a malformed or other-version blob

// A digest of a file's header bytes (XXH3 of the length prefix and the JSON): equal digests mean the
// same tensors at the same offsets.
uint64_t FileDigest(const SafetensorsFile& file);
// The file's name relative to the checkpoint root.
std::string RelativeName(const Checkpoint& ckpt, size_t file);

// Throws kManifestMismatch / kCheckpoint naming the key, file and both values. An fp8 checkpoint
// tensor going to a BF16/F16/F32 entry is dequantized with its "<key>_scale_inv" in blocks of
// `block` (the checkpoint config's quantization_config.weight_block_size); one without a scale, or
// with a scale that is not its block grid, is a kCheckpoint error naming the key, never a raw cast.
Manifest Resolve(const Plan& plan, const Checkpoint& ckpt, const KeyMapping& mapping, const StreamParams& params,
                 BlockSize block = {});
// Entries with at least one dequantized part.
uint64_t DequantizedEntries(const Manifest& m);

// Returns this rank's first difference from rank 0's manifest, or "" when it agrees (a layout differs:
// the key, both ranks and both layouts). world_size: the communicator's.
std::string CheckManifest(const Manifest& m, const Plan& plan, int rank, int world_size);
// The checkpoint bytes the manifest's entries read once (their parts' source bytes).
uint64_t SourceBytes(const Manifest& m);
// Returns the options this rank asked for that change results and differ from the reader's, or "".
std::string CheckParams(const StreamParams& reader, const LoadOptions& mine, int rank);

}  // namespace shardcast
