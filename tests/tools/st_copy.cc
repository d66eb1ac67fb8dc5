// st_copy IN OUT: reads every tensor of IN with shardcast's reader and writes them to OUT with its
// writer, metadata kept. The Python interop test runs reference-written files through it and has
// the reference read the result back bit-exactly, which checks our reader and writer together.
#include <cstdio>
#include <vector>

#include "allocators/error.h"
#include "loaders/safetensors_file.h"
#include "loaders/writer.h"

int main(int argc, char** argv) {
  if (argc != 3) {
    std::fprintf(stderr, "usage: st_copy IN OUT\n");
    return 2;
  }
  try {
    auto in = shardcast::SafetensorsFile::Open(argv[1]);
    std::vector<shardcast::WriteEntry> entries;
    for (const auto& t : in->header().tensors) entries.push_back({t.key, t.dtype, t.shape});
    shardcast::SafetensorsWriter out(argv[2], entries, in->header().metadata);
    for (const auto& t : in->header().tensors) {
      std::vector<unsigned char> buf(t.nbytes());
      in->ReadRows(t, 0, t.rows(), buf.data());
      out.Append(buf.data(), buf.size());
    }
    out.Commit();
  } catch (const shardcast::Error& e) {
    std::fprintf(stderr, "st_copy: %s\n", e.what());
    return 2;
  }
  return 0;
}
