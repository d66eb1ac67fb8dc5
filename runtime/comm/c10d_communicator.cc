#include "runtime/comm/c10d_communicator.h"

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <exception>

#include "allocators/error.h"
#include "runtime/agree/failure.h"
#include "runtime/agree/fault.h"
#include "runtime/agree/verdict.h"
#include "runtime/comm/c10d_backend.h"
#include "runtime/comm/gloo_group.h"
#include "runtime/comm/gloo_groups.h"
#include "runtime/comm/store_channel.h"

namespace shardcast {
namespace {

class LocalCommunicator : public Communicator {
 public:
  int rank() const override { return 0; }
  int world_size() const override { return 1; }
  std::string backend() const override { return "local"; }
  std::chrono::milliseconds timeout() const override { return std::chrono::milliseconds(0); }
  void Broadcast(void*, uint64_t, int) override {}
  std::unique_ptr<PendingSend> SendAsync(const void*, uint64_t, int peer) override {
    throw Error(ErrorKind::kInternal, "local communicator", "no peer " + std::to_string(peer));
  }
  void Recv(void*, uint64_t, int peer) override {
    throw Error(ErrorKind::kInternal, "local communicator", "no peer " + std::to_string(peer));
  }
  void AllReduceSum(int64_t*, uint64_t) override {}
  void Barrier() override {}
  void Abort() override {}
};

}  // namespace

std::string StoreHost(const Rendezvous& rv) {
  return "rank 0 (the store host at " + rv.master_addr + ":" + std::to_string(rv.master_port) + ")";
}

StoreAddress StoreAt(const Rendezvous& rv) { return StoreAddress{rv.master_addr, rv.master_port}; }

namespace {

// Where `store` listens: a TCPStore's host and port, under any PrefixStores (the caller's process group's
// store, from init_process_group or the torchrun agent); not known for any other store.
StoreAddress AddressOf(const c10::intrusive_ptr<c10d::Store>& store) {
  c10::intrusive_ptr<c10d::Store> base = store;
  if (auto* prefixed = dynamic_cast<c10d::PrefixStore*>(base.get())) base = prefixed->getUnderlyingNonPrefixStore();
  if (auto* tcp = dynamic_cast<c10d::TCPStore*>(base.get())) return StoreAddress{tcp->getHost(), tcp->getPort()};
  return {};
}

}  // namespace

std::unique_ptr<Communicator> WrapC10dBackend(c10::intrusive_ptr<c10d::Backend> backend, std::chrono::milliseconds timeout,
                                              c10::intrusive_ptr<c10d::Store> store, c10::Device device,
                                              std::string store_host) {
  return std::make_unique<C10dCommunicator>(std::move(backend), std::move(store), std::move(store_host), timeout,
                                            device, /*owns=*/false);
}

std::unique_ptr<Communicator> CreateLocalCommunicator() { return std::make_unique<LocalCommunicator>(); }

void IgnoreBrokenPipes() {
  struct sigaction now {};
  if (sigaction(SIGPIPE, nullptr, &now) == 0 && now.sa_handler == SIG_DFL) std::signal(SIGPIPE, SIG_IGN);
}

std::chrono::milliseconds RendezvousDeadline(std::chrono::milliseconds timeout) {
  return timeout + timeout / 4 + std::chrono::milliseconds(3000);
}

Error RendezvousError(const Rendezvous& rv, const char* phase, const std::exception& e) {
  const std::string where = "rank " + std::to_string(rv.rank) + " rendezvous at " + rv.master_addr + ":" +
                            std::to_string(rv.master_port);
  if (auto* se = dynamic_cast<const Error*>(&e)) return Error(se->kind(), where, se->what());  // ours: its kind
  std::string m = CleanC10dMessage(e.what());
  if (auto* c = dynamic_cast<const c10::Error*>(&e)) m = CleanC10dMessage(c->what_without_backtrace());
  // A worker whose connection to the store broke, or never came up, has lost rank 0: the same
  // words as a rank that lost it later, mid-load.
  if (rv.rank != 0 && dynamic_cast<const c10::DistNetworkError*>(&e) != nullptr) {
    const FailureNote n = LooksLikeTimeout(m) ? StoreUnanswered(StoreHost(rv), StoreAt(rv)) : StoreLost(StoreHost(rv));
    return Error(n.kind, phase, n.message);
  }
  return Error(LooksLikeTimeout(m) ? ErrorKind::kCommTimeout : ErrorKind::kComm, where, m);
}

namespace {

struct AgreedGroup {
  c10::intrusive_ptr<c10d::Backend> backend;
  std::string token;
  bool reused = false;        // a kept group, ready since the operation that made it
  std::exception_ptr failed;  // the making of the group threw this (backend null): FailMakingTogether
};

// A timed-out wait for gloo's addresses names the ranks that never published theirs (c10d names only keys).
std::string WithAbsentRanks(const std::string& m, int world_size) {
  if (!LooksLikeTimeout(m)) return m;
  const std::vector<int> ranks = RanksOfTimedOutKeys(m, world_size);
  if (ranks.empty()) return m;
  return m + " (no address from " + (ranks.size() == 1 ? "rank " : "ranks ") + RankList(ranks) +
         ": died, frozen, or not in the same shardcast operation)";
}

// A group whose making failed on this rank while the store answers: a peer died or froze just after its
// own group was made, before the barrier that readies it (FaultPoint "group"), or failed its own making,
// and this rank's connects to it failed. Peers that made theirs fail in that barrier under FailTogether;
// this rank joins the same agreement on the same store, so every survivor raises one error, rank 0's
// (naming the ranks that never came to the group) or the store's loss. As FailTogether: rank 0
// publishes, every other rank takes what is published within kFailureFetchWait, else publishes its own.
// named: `e` needs no ranks named: it names those that never came already (WithAbsentRanks, from gloo's
// keys), or it is this rank's own failure (a shardcast Error it raised), which no absent peer caused.
[[noreturn]] void FailMakingTogether(const c10::intrusive_ptr<c10d::Store>& store, std::string store_host,
                                     StoreAddress store_at, int rank, int world_size, const Error& e,
                                     bool named, const char* phase) {
  StoreChannel channel(store, std::move(store_host), std::move(store_at));
  channel.Reach(kArrivedStep, rank);  // alive: not one of the ranks rank 0 names
  const Error full = named ? e : WithAbsentFromGroup(channel, e, rank, world_size);
  const FailureNote mine{full.kind(), full.what()};
  std::optional<FailureNote> agreed;
  if (rank != 0) agreed = channel.Fetch(kFailureFetchWait);
  if (!agreed) agreed = channel.Publish(mine);
  if (rank == 0) channel.AwaitAcks(world_size - 1, kFailureAckWait);
  const FailureNote final = agreed.value_or(mine);
  throw Error(final.kind, phase, final.message);
}

// Whether a rank published a failure while this rank's group is made: a rank whose own making failed
// (FailMakingTogether) never publishes the address gloo waits for here, so without this every other rank
// waited out gloo's timeout (10 minutes by default) before taking the note. Asked over a connection of its
// own (gloo's wait holds the store's), made at the first ask, each ask bounded by 1 s; never where the
// store cannot be cloned or answers late. The making, abandoned then, still holds the store's connection
// until gloo's timeout: a later operation of this process waits for it (a job that ends on the error does
// not; a retry in the same process is slow, not wrong).
struct FailureWatch {
  bool tried = false;
  c10::intrusive_ptr<c10d::Store> own;  // the clone: also the store the agreement then runs on
  std::unique_ptr<StoreChannel> channel;
};
std::function<bool()> FailurePublished(const std::shared_ptr<FailureWatch>& watch,
                                       const c10::intrusive_ptr<c10d::Store>& store, const std::string& host) {
  return [watch, store, host]() {
    if (!watch->tried) {
      watch->tried = true;
      std::function<c10::intrusive_ptr<c10d::Store>()> clone = [store] { return store->clone(); };
      try {
        std::optional<c10::intrusive_ptr<c10d::Store>> own = WithDeadline(std::move(clone), std::chrono::seconds(1));
        if (own && *own) {
          watch->own = *own;
          watch->channel = std::make_unique<StoreChannel>(*own, host, StoreAddress{}, std::chrono::seconds(1));
        }
      } catch (...) {  // a store that cannot be cloned: no watch, the making's own deadline stands
      }
    }
    return watch->channel && watch->channel->Published();
  };
}

// What the making of a group threw, as a communication error of ours; *named: whether it needs no ranks
// named (FailMakingTogether): its message names the ranks that never published their addresses, or it is
// a shardcast Error this rank raised itself (an allocation refused; gloo raises none of ours).
Error MakingError(const std::exception_ptr& failed, const std::string& where, int world_size, bool* named) {
  *named = false;
  auto comm = [&](const std::string& m) {
    const std::string out = WithAbsentRanks(m, world_size);
    *named = out != m;
    return Error(LooksLikeTimeout(m) ? ErrorKind::kCommTimeout : ErrorKind::kComm, where, out);
  };
  try {
    std::rethrow_exception(failed);
  } catch (const Error& e) {
    *named = true;
    return Error(e.kind(), where, e.what());
  } catch (const c10::Error& e) {
    return comm(CleanC10dMessage(e.what_without_backtrace()));
  } catch (const std::exception& e) {
    return comm(CleanC10dMessage(e.what()));
  } catch (...) {
    return Error(ErrorKind::kInternal, where, "the Gloo group threw a non-exception");
  }
}

}  // namespace

std::unique_ptr<Communicator> CreateGlooCommunicatorOnStore(c10::intrusive_ptr<c10d::Store> store, int rank,
                                                            int world_size, std::chrono::milliseconds timeout,
                                                            std::string store_host, std::vector<int> absent,
                                                            const char* phase) {
  IgnoreBrokenPipes();
  const char* env_addr = std::getenv("MASTER_ADDR");
  const std::string master_addr = env_addr ? env_addr : "";
  std::optional<KeptGroup> kept = TakeKept(store, rank, world_size, timeout);
  std::function<AgreedGroup()> make = [store, rank, world_size, timeout, master_addr, kept, absent]() -> AgreedGroup {
    const std::string decided = AgreeOnGroup(*store, kept ? kept->token : "", rank, world_size, timeout, absent);
    if (decided.rfind("reuse ", 0) == 0) return {kept->backend, kept->token, /*reused=*/true, nullptr};
    const std::string token = decided.substr(decided.find(' ') + 1);
    try {
      FaultPoint("make", rank);
      return {MakeGlooGroup(store, rank, world_size, timeout, master_addr, kGlooConnect), token, false, nullptr};
    } catch (...) {
      return {nullptr, token, false, std::current_exception()};
    }
  };
  kept.reset();  // the lambda holds the only reference: a group not reused is torn down with it
  const std::string where = "rank " + std::to_string(rank) + ": this operation's Gloo group (" +
                            std::to_string(world_size) + " ranks, over " + store_host + ")";
  std::optional<AgreedGroup> agreed;
  bool published = false;
  auto watch = std::make_shared<FailureWatch>();
  try {
    agreed = WithDeadlineUnless(std::move(make), RendezvousDeadline(timeout), FailurePublished(watch, store, store_host),
                                std::chrono::milliseconds(std::max(100, world_size)), &published);
  } catch (const Error& e) {
    throw Error(e.kind(), where, e.what());
  } catch (const c10::Error& e) {
    throw Error(LooksLikeTimeout(e.what_without_backtrace()) ? ErrorKind::kCommTimeout : ErrorKind::kComm, where,
                WithAbsentRanks(CleanC10dMessage(e.what_without_backtrace()), world_size));
  } catch (const std::exception& e) {
    throw Error(LooksLikeTimeout(e.what()) ? ErrorKind::kCommTimeout : ErrorKind::kComm, where,
                WithAbsentRanks(CleanC10dMessage(e.what()), world_size));
  }
  if (published) {  // a rank failed while the group was made, and said so: this rank takes its note now, over
                     // the watch's connection (the store's own is held by gloo's wait, abandoned with its thread)
    FailMakingTogether(watch->own, std::move(store_host), AddressOf(store), rank, world_size,
                       Error(ErrorKind::kComm, where, "another rank failed while the group was made"), true, phase);
  }
  if (!agreed) {
    throw Error(ErrorKind::kCommTimeout, where,
                "not made within " + std::to_string(RendezvousDeadline(timeout).count()) +
                    " ms: the store does not answer (the rank that hosts it died or is frozen), or a rank died "
                    "or froze while the group was made");
  }
  if (agreed->failed) {
    bool named = false;
    const Error e = MakingError(agreed->failed, where, world_size, &named);
    FailMakingTogether(store, std::move(store_host), AddressOf(store), rank, world_size, e, named, phase);
  }
  auto comm = std::make_unique<C10dCommunicator>(std::move(agreed->backend), store, std::move(store_host), timeout,
                                                 c10::Device(c10::kCPU), /*owns=*/true, AddressOf(store));
  comm->token = agreed->token;
  comm->group = GroupOf(store);
  if (!agreed->reused) comm->Ready(phase);
  return comm;
}

void KeepGlooGroup(std::unique_ptr<Communicator> comm) {
  auto* c = dynamic_cast<C10dCommunicator*>(comm.get());
  if (c == nullptr) return;
  c10::intrusive_ptr<c10d::Backend> backend = c->Release();
  if (!backend) return;
  PutKept(c->group, KeptGroup{std::move(backend), c->token, c->rank(), c->world_size(), c->timeout()});
}

void ForgetGlooGroups() { ForgetKept(); }

std::unique_ptr<Communicator> CreateGlooCommunicator(const Rendezvous& rv, std::chrono::milliseconds timeout,
                                                     const char* phase) {
  IgnoreBrokenPipes();
  struct Made {
    c10::intrusive_ptr<c10d::Backend> backend;
    std::exception_ptr failed;  // the making of the group threw this, the store up: FailMakingTogether
  };
  // The TCPStore client and gloo's rendezvous read the store with no deadline of their own: against a
  // frozen rank 0 they would wait forever. So the whole rendezvous (the store, then the group) runs under
  // one deadline.
  const auto until = std::chrono::steady_clock::now() + RendezvousDeadline(timeout);
  std::function<c10::intrusive_ptr<c10d::Store>()> connect = [rv, timeout]() -> c10::intrusive_ptr<c10d::Store> {
    c10d::TCPStoreOptions so;
    so.port = static_cast<uint16_t>(rv.master_port);
    so.isServer = rv.rank == 0;
    so.numWorkers = rv.world_size;
    so.waitWorkers = true;
    so.timeout = timeout;
    if (rv.rank == 0 && rv.listen_fd >= 0) so.masterListenFd = rv.listen_fd;  // bound by the launcher: no port race
    auto store = c10::make_intrusive<c10d::TCPStore>(rv.master_addr, so);
    return c10::make_intrusive<c10d::PrefixStore>("shardcast", store);
  };
  // Then the group, watched as CreateGlooCommunicatorOnStore's is: a rank that fails its own making
  // (rank 0 too, whose store the others read) publishes its error, and the others take it at once rather
  // than after gloo's timeout, when rank 0 has ended and its store with it.
  std::optional<c10::intrusive_ptr<c10d::Store>> store;
  std::optional<Made> made;
  bool published = false;
  auto watch = std::make_shared<FailureWatch>();
  auto left = [&until] {
    return std::max(std::chrono::milliseconds(0), std::chrono::duration_cast<std::chrono::milliseconds>(
                                                      until - std::chrono::steady_clock::now()));
  };
  try {
    store = WithDeadline(std::move(connect), left());
    if (store) {
      std::function<Made()> make = [rv, timeout, s = *store]() -> Made {
        try {
          FaultPoint("make", rv.rank);
          return {MakeGlooGroup(s, rv.rank, rv.world_size, timeout, rv.master_addr, kGlooConnect), nullptr};
        } catch (...) {
          return {nullptr, std::current_exception()};
        }
      };
      made = WithDeadlineUnless(std::move(make), left(), FailurePublished(watch, *store, StoreHost(rv)),
                                std::chrono::milliseconds(std::max(100, rv.world_size)), &published);
    }
  } catch (const std::exception& e) {
    throw RendezvousError(rv, phase, e);
  }
  if (published) {  // a rank failed while the group was made, and said so: take its note over the watch's
                    // connection (the store's own is held by gloo's wait, abandoned with its thread)
    FailMakingTogether(watch->own, StoreHost(rv), StoreAt(rv), rv.rank, rv.world_size,
                       Error(ErrorKind::kComm, "rank " + std::to_string(rv.rank),
                             "another rank failed while the group was made"),
                       true, phase);
  }
  if (!made) {
    if (rv.rank != 0) {
      const FailureNote n = StoreUnanswered(StoreHost(rv), StoreAt(rv));
      throw Error(n.kind, phase, n.message);
    }
    throw Error(ErrorKind::kCommTimeout, "rank 0 rendezvous at " + rv.master_addr + ":" + std::to_string(rv.master_port),
                "did not complete within " + std::to_string(RendezvousDeadline(timeout).count()) + " ms");
  }
  if (made->failed) {
    bool own = false;  // this rank's own failure (a shardcast Error): no absent peer to name
    const Error mine = [&] {
      try {
        std::rethrow_exception(made->failed);
      } catch (const Error& e) {
        own = true;
        return RendezvousError(rv, "", e);  // the phase is FailMakingTogether's to add
      } catch (const std::exception& e) {
        return RendezvousError(rv, "", e);
      } catch (...) {
        return Error(ErrorKind::kInternal, "rank " + std::to_string(rv.rank), "the Gloo group threw a non-exception");
      }
    }();
    FailMakingTogether(*store, StoreHost(rv), StoreAt(rv), rv.rank, rv.world_size, mine, own, phase);
  }
  auto comm = std::make_unique<C10dCommunicator>(std::move(made->backend), *store, StoreHost(rv), timeout,
                                                 c10::Device(c10::kCPU), /*owns=*/true, StoreAt(rv));
  comm->Ready(phase);
  return comm;
}

}  // namespace shardcast
