// A program outside shardcast's tree, built against the public headers alone (tests/api/CMakeLists.txt):
// load a checkpoint into this rank's FSDP2 shards with nothing but the API, and check what came back.
//
//   api_consumer CHECKPOINT_DIR     (RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT as torchrun sets them;
//                                    none set: one rank)
#include <cstdio>
#include <memory>
#include <string>

#include "runtime/load.h"

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s CHECKPOINT_DIR\n", argv[0]);
    return 2;
  }
  const std::string checkpoint = argv[1];
  try {
    const shardcast::Rendezvous rv = shardcast::RendezvousFromEnvironment();
    shardcast::LoadRequest request;
    request.checkpoint = checkpoint;
    request.options = shardcast::LoadOptionsBuilder().FromEnvironment().Build();
    std::unique_ptr<shardcast::Communicator> comm =
        rv.world_size == 1 ? shardcast::CreateLocalCommunicator()
                           : shardcast::CreateGlooCommunicator(rv, request.options.timeout);

    shardcast::Plan plan = shardcast::Plan::Build(shardcast::BuildModelSpec(checkpoint + "/config.json"), rv.world_size);
    shardcast::RankState state = shardcast::RankState::Prepare(plan, rv.rank);
    const shardcast::LoadReport report = shardcast::Load(*comm, &state, request);

    // Every entry of the plan holds real memory of its local shape; the checkpoint's entries (all but the
    // computed buffers, e.g. RoPE's inv_freq) were loaded, and the bytes stored are theirs.
    uint64_t local_bytes = 0, from_checkpoint = 0;
    for (const shardcast::LocalTensor& t : state.tensors()) {
      if (t.is_meta()) {
        std::fprintf(stderr, "rank %d: %s is still on the meta device after Load\n", rv.rank, t.entry->key.c_str());
        return 1;
      }
      if (!t.from_checkpoint) continue;
      ++from_checkpoint;
      local_bytes += t.tensor.numel() * t.tensor.element_size();
    }
    const shardcast::RankReport& mine = report.ranks.at(rv.rank);
    if (report.entries != from_checkpoint || report.skipped_keys != 0 || mine.bytes_stored != local_bytes ||
        local_bytes == 0) {
      std::fprintf(stderr, "rank %d: %llu of %llu entries, %llu skipped, %llu bytes stored against %llu held\n",
                   rv.rank, static_cast<unsigned long long>(report.entries),
                   static_cast<unsigned long long>(from_checkpoint),
                   static_cast<unsigned long long>(report.skipped_keys),
                   static_cast<unsigned long long>(mine.bytes_stored), static_cast<unsigned long long>(local_bytes));
      return 1;
    }
    std::printf("rank %d: %llu entries, %llu bytes into this rank's shards (%s)\n", rv.rank,
                static_cast<unsigned long long>(report.entries), static_cast<unsigned long long>(local_bytes),
                report.source.c_str());
    return 0;
  } catch (const shardcast::Error& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 1;
  }
}
