#include "runtime/launch_env.h"

#include <cstdlib>
#include <string>
#include <vector>

#include "allocators/error.h"
#include "runtime/agree/communicator.h"

namespace shardcast {
namespace {

constexpr long kMaxEnvInt = 1l << 30;

[[noreturn]] void Bad(const std::string& name, const std::string& text, const std::string& why) {
  throw Error(ErrorKind::kInvalidArgument, name, "\"" + text + "\" " + why);
}

// A non-negative decimal at text[*at], advancing *at past it; -1 when there is none.
long Digits(const std::string& text, size_t* at) {
  long x = 0;
  const size_t begin = *at;
  while (*at < text.size() && text[*at] >= '0' && text[*at] <= '9') {
    x = x * 10 + (text[*at] - '0');
    if (x > kMaxEnvInt) return -1;
    ++*at;
  }
  return *at == begin ? -1 : x;
}

int EnvInt(const char* name, int fallback) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return fallback;
  char* end = nullptr;
  long x = std::strtol(v, &end, 10);
  if (*end != '\0' || x < 0 || x > kMaxEnvInt) Bad(name, v, "is not a non-negative integer");
  return static_cast<int>(x);
}

}  // namespace

int SlurmTasksOnNode(const std::string& name, const std::string& text, int node) {
  const char* form = "is not a SLURM task count list (\"8\", \"8(x2)\", \"2(x3),1\")";
  struct Item {
    long count, nodes;
  };
  std::vector<Item> items;
  size_t at = 0;
  do {
    if (!items.empty()) ++at;  // the comma
    const long count = Digits(text, &at);
    if (count < 0) Bad(name, text, form);
    long nodes = 1;
    if (text.compare(at, 2, "(x") == 0) {
      at += 2;
      nodes = Digits(text, &at);
      if (nodes < 1 || at >= text.size() || text[at] != ')') Bad(name, text, form);
      ++at;
    }
    items.push_back({count, nodes});
  } while (at < text.size() && text[at] == ',');
  if (at != text.size()) Bad(name, text, form);
  long first = 0;  // the first node of each item
  for (const Item& item : items) {
    if (node < first + item.nodes) return static_cast<int>(item.count);
    first += item.nodes;
  }
  Bad(name, text, "lists " + std::to_string(first) + " node(s), and this is node " + std::to_string(node) + " (SLURM_NODEID)");
}

Rendezvous RendezvousFromEnvironment() {
  Rendezvous rv;
  if ((std::getenv("RANK") != nullptr) != (std::getenv("WORLD_SIZE") != nullptr)) {
    // Half of torchrun's pair: read as no launcher, every process would load alone as a world of one.
    const char* given = std::getenv("RANK") ? "RANK" : "WORLD_SIZE";
    throw Error(ErrorKind::kInvalidArgument, "torchrun environment",
                std::string(given) + " is set but " + (std::getenv("RANK") ? "WORLD_SIZE" : "RANK") +
                    " is not: set both (torchrun does), or neither for a single process");
  }
  if (std::getenv("RANK") && std::getenv("WORLD_SIZE")) {
    rv.source = "torchrun";
    rv.rank = EnvInt("RANK", 0);
    rv.world_size = EnvInt("WORLD_SIZE", 1);
    rv.local_rank = EnvInt("LOCAL_RANK", rv.rank);
    rv.local_world_size = EnvInt("LOCAL_WORLD_SIZE", rv.world_size);
  } else if (std::getenv("SLURM_PROCID") && std::getenv("SLURM_NTASKS")) {
    rv.source = "slurm";
    rv.rank = EnvInt("SLURM_PROCID", 0);
    rv.world_size = EnvInt("SLURM_NTASKS", 1);
    rv.local_rank = EnvInt("SLURM_LOCALID", 0);
    const char* per_node = std::getenv("SLURM_NTASKS_PER_NODE");
    rv.local_world_size = per_node == nullptr || *per_node == '\0'
                              ? rv.world_size
                              : SlurmTasksOnNode("SLURM_NTASKS_PER_NODE", per_node, EnvInt("SLURM_NODEID", 0));
    if (const char* ip = std::getenv("SLURM_LAUNCH_NODE_IPADDR")) rv.master_addr = ip;
  } else {
    rv.source = "default";
  }
  if (const char* addr = std::getenv("MASTER_ADDR")) rv.master_addr = addr;
  rv.master_port = EnvInt("MASTER_PORT", rv.master_port);
  if (rv.rank == 0 && std::getenv("SHARDCAST_LISTEN_FD")) rv.listen_fd = EnvInt("SHARDCAST_LISTEN_FD", -1);
  if (rv.world_size < 1 || rv.rank >= rv.world_size) {
    throw Error(ErrorKind::kInvalidArgument, rv.source + " environment",
                "rank " + std::to_string(rv.rank) + " is outside world size " + std::to_string(rv.world_size));
  }
  return rv;
}

}  // namespace shardcast
