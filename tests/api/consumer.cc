// A program outside shardcast's tree, built against the public headers alone (tests/api/CMakeLists.txt):
// load a checkpoint into this rank's FSDP2 shards with nothing but the API, and check what came back.
//
//   api_consumer CHECKPOINT_DIR [--broken-on-rank R]
//     RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT as torchrun sets them; none set: one rank.
//     --broken-on-rank R: rank R's config path is wrong, so it cannot build its plan and calls FailLoad
//     where the others call Load. Passes when every rank raised the same ConfigError naming that path
//     (not a timeout: the others heard of it at once).
#include <cstdio>
#include <memory>
#include <optional>
#include <string>

#include "runtime/load.h"

int main(int argc, char** argv) {
  if (argc != 2 && !(argc == 4 && std::string(argv[2]) == "--broken-on-rank")) {
    std::fprintf(stderr, "usage: %s CHECKPOINT_DIR [--broken-on-rank R]\n", argv[0]);
    return 2;
  }
  const std::string checkpoint = argv[1];
  const int broken_rank = argc == 4 ? std::stoi(argv[3]) : -1;
  const std::string missing = checkpoint + "/no-such-config.json";
  int rank = 0;
  try {
    const shardcast::Rendezvous rv = shardcast::RendezvousFromEnvironment();
    rank = rv.rank;
    shardcast::LoadRequest request;
    request.checkpoint = checkpoint;
    request.options = shardcast::LoadOptionsBuilder().FromEnvironment().Build();
    std::unique_ptr<shardcast::Communicator> comm =
        rv.world_size == 1 ? shardcast::CreateLocalCommunicator()
                           : shardcast::CreateGlooCommunicator(rv, request.options.timeout);

    std::optional<shardcast::Plan> plan;
    std::optional<shardcast::RankState> state;
    try {
      const std::string config = rv.rank == broken_rank ? missing : checkpoint + "/config.json";
      plan.emplace(shardcast::Plan::Build(shardcast::BuildModelSpec(config), rv.world_size));
      state.emplace(shardcast::RankState::Prepare(*plan, rv.rank));
    } catch (const shardcast::Error& e) {
      shardcast::FailLoad(*comm, e.kind(), e.what());
    }
    const shardcast::LoadReport report = shardcast::Load(*comm, &*state, request);
    if (broken_rank >= 0) {
      std::fprintf(stderr, "rank %d: Load succeeded although rank %d could not plan\n", rv.rank, broken_rank);
      return 1;
    }

    // Every entry of the plan holds real memory of its local shape; the checkpoint's entries (all but the
    // computed buffers, e.g. RoPE's inv_freq) were loaded, and the bytes stored are theirs.
    uint64_t local_bytes = 0, from_checkpoint = 0;
    for (const shardcast::LocalTensor& t : state->tensors()) {
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
    const std::string what = e.what();
    if (broken_rank >= 0 && e.kind() == shardcast::ErrorKind::kConfig && what.find(missing) != std::string::npos) {
      std::printf("rank %d: the agreed error: %s\n", rank, what.c_str());
      return 0;
    }
    std::fprintf(stderr, "rank %d: %s: %s\n", rank, shardcast::ErrorKindName(e.kind()), what.c_str());
    return 1;
  }
}
