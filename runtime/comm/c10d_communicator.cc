#include "runtime/comm/c10d_communicator.h"

#include <ATen/ATen.h>
#include <ATen/ops/from_blob.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#include <torch/version.h>

#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <thread>

#include "allocators/error.h"
#include "runtime/agree/failure.h"
#include "runtime/agree/fault.h"
#include "runtime/agree/verdict.h"
#include "runtime/comm/gloo_group.h"
#include "runtime/comm/gloo_groups.h"
#include "runtime/comm/store_channel.h"

namespace shardcast {
namespace {

// The first line of a c10d/gloo message, without gloo's advice and source location.
std::string Clean(const std::string& m) {
  std::string s = m.substr(0, m.find('\n'));
  size_t advice = s.find(" This is typically caused");
  if (advice != std::string::npos) s = s.substr(0, advice);
  if (s.rfind("[", 0) == 0 && s.find("] ") != std::string::npos) s = s.substr(s.find("] ") + 2);
  return s;
}

class C10dCommunicator : public Communicator {
 public:
  // store_host: who serves `store`, for the messages of a store that stops answering; store_at: where it
  // listens, where known (the store a Rendezvous makes).
  C10dCommunicator(c10::intrusive_ptr<c10d::Backend> backend, c10::intrusive_ptr<c10d::Store> store,
                   std::string store_host, std::chrono::milliseconds timeout, c10::Device device, bool owns,
                   StoreAddress store_at = {})
      : backend_(std::move(backend)), channel_(std::move(store), std::move(store_host), std::move(store_at)),
        timeout_(timeout), device_(device), owns_(owns), rank_(backend_->getRank()), size_(backend_->getSize()) {}

  std::optional<FailureNote> PublishFailure(const FailureNote& mine) override { return channel_.Publish(mine); }
  std::optional<FailureNote> FetchFailure(std::chrono::milliseconds wait) override { return channel_.Fetch(wait); }
  void AwaitFailureAcks(int n, std::chrono::milliseconds wait) override { channel_.AwaitAcks(n, wait); }

  ~C10dCommunicator() override = default;

  // The Gloo group's identity between operations (KeepGlooGroup): its token, agreed by every rank, and
  // the store its operations' prefixes share; an empty token for a group not to be kept.
  std::string token;
  const c10d::Store* group = nullptr;

  // The backend, for the next operation, where this one owns it and finished well; else null.
  c10::intrusive_ptr<c10d::Backend> Release() {
    std::lock_guard<std::mutex> lock(mu_);
    if (finished_ || !owns_ || token.empty()) return {};
    finished_ = "kept for the next operation";
    return std::move(backend_);
  }

  int rank() const override { return rank_; }
  int world_size() const override { return size_; }
  std::string backend() const override { return backend_ ? backend_->getBackendName() : "finished"; }
  std::chrono::milliseconds timeout() const override { return timeout_; }

  void Broadcast(void* data, uint64_t bytes, int root) override {
    if (bytes == 0) return;
    Run("broadcast of " + std::to_string(bytes) + " bytes from rank " + std::to_string(root), [&] {
      std::vector<at::Tensor> t = {Wrap(data, bytes)};
      c10d::BroadcastOptions o;
      o.rootRank = root;
      o.timeout = timeout_;
      Wait(backend_->broadcast(t, o));
    });
  }

  std::unique_ptr<PendingSend> SendAsync(const void* data, uint64_t bytes, int peer) override {
    std::unique_ptr<PendingSend> out;
    Run("send of " + std::to_string(bytes) + " bytes to rank " + std::to_string(peer), [&] {
      auto tensors = std::make_shared<std::vector<at::Tensor>>(1, Wrap(const_cast<void*>(data), bytes));
      out = std::make_unique<Pending>(this, backend_->send(*tensors, peer, /*tag=*/0), tensors, peer, bytes);
    });
    return out;
  }

  void Recv(void* data, uint64_t bytes, int peer) override {
    if (bytes == 0) return;
    Run("receive of " + std::to_string(bytes) + " bytes from rank " + std::to_string(peer), [&] {
      std::vector<at::Tensor> t = {Wrap(data, bytes)};
      Wait(backend_->recv(t, peer, /*tag=*/0));
    });
  }

  void AllReduceSum(int64_t* values, uint64_t count) override {
    Run("all-reduce of " + std::to_string(count) + " values", [&] {
      std::vector<at::Tensor> t = {at::from_blob(values, {static_cast<int64_t>(count)}, at::kLong)};
      c10d::AllreduceOptions o;
      o.reduceOp = c10d::ReduceOp::SUM;
      o.timeout = timeout_;
      Wait(backend_->allreduce(t, o));
    });
  }

  void Barrier() override { BarrierAs("barrier"); }

  void BarrierAs(const std::string& what) {
    Run(what, [&] {
      c10d::BarrierOptions o;
      o.timeout = timeout_;
      Wait(backend_->barrier(o));
    });
  }

  // Readies a group just made (MakeGlooGroup) on every rank with its first collective, a barrier: no rank
  // goes on while a peer still makes its own group, so a fast rank's later failure cannot hit a peer that
  // is still making it. But a barrier tells a rank only that every rank entered it, not that every rank
  // left: a fast rank may leave, go on and die or freeze (or fail and abort its pairs) while a slow one
  // still waits in the barrier for its last message, or, in a lazy group, for a pair the barrier connects.
  // So the barrier is the operation's first step, under the failure agreement of `phase` like every later
  // one: the slow rank raises what the others raise (the cause the failed rank published, or rank 0 lost or
  // silent), never a rendezvous error of its own. Lazy groups made this window wide (their pairs connect
  // inside the barrier) and lost the fault matrix's one-error rule to it; a full mesh has it too, narrower
  // (tests/runtime/fault_test.cc, Group/Faults: both failed every case before).
  //
  // A lazy group's barrier also connects every pair a collective of ours uses. Gloo's dissemination
  // barrier talks to r + d and r - d (mod W) for d = 1, 2, 4, ...; its ring all-reduce to r +- 1; its
  // binomial broadcast, from any root, to r +- 2^i. So after the barrier no collective reads the store
  // or makes a first contact:
  //
  //   W = 8, rank 0:   barrier d=1: 1, 7   d=2: 2, 6   d=4: 4     all-reduce: 1, 7   broadcast: 1, 2, 4 (root 0)
  //                    never connected: 3, 5 (until a send or receive of a stream's route names them)
  //
  // 2 log2(W) pairs a rank at most, where a full mesh makes W - 1 (at W <= 4 they are the same pairs).
  //
  // A barrier that fails says nothing of who is missing, so every rank adds itself to the store's list of
  // those that entered it first, and rank 0 (whose failure note every rank raises, as it hosts the store)
  // names the ranks not on the list: they died or froze before it. One append a rank on the way in, one read
  // only on failure.
  void Ready(const char* phase) {
    readying_ = true;
    try {
      FaultPoint("group", rank_);
      channel_.Reach("ready", rank_);
      try {
        BarrierAs("the barrier that readies this operation's Gloo group (" + std::to_string(size_) + " ranks)");
      } catch (const Error& e) {
        throw WithMissing(e);
      }
    } catch (const std::exception& e) {
      FailTogether(*this, e, phase);
    }
    readying_ = false;
  }

  void Abort() override {
    std::lock_guard<std::mutex> lock(mu_);
    if (!finished_) finished_ = "aborted";
    if (backend_ && owns_) {
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 7)
      try {  // c10d::Backend::abort() exists from torch 2.7; before it, the reset below is the abort
        backend_->abort();
      } catch (...) {
      }
#endif
      // Closes the pairs (peers blocked on us see "connection closed" at once) when the last pending
      // send is gone: each send's unbound buffer holds gloo's context, so its pairs stay open until the
      // caller destroys its PendingSends. Joins the worker threads: no collective is left running.
      if (!readying_) {
        backend_.reset();
        return;
      }
      // Except the ready barrier's, past the timeout: in a lazy group it may wait in a pair's first connect
      // for a peer that died, and gloo waits 5 x the timeout for that (pair.h, "a longer timeout when waiting
      // for initial connect"). The barrier holds no bytes of the caller, so its teardown may finish later,
      // on a thread of its own, holding the group until then.
      std::function<bool()> teardown = [group = std::move(backend_)]() mutable {
        group.reset();
        return true;
      };
      WithDeadline(std::move(teardown), timeout_);
    }
  }

 private:
  struct Pending : PendingSend {
    Pending(C10dCommunicator* c, c10::intrusive_ptr<c10d::Work> w, std::shared_ptr<std::vector<at::Tensor>> t, int peer,
            uint64_t bytes)
        : comm(c), work(std::move(w)), tensors(std::move(t)), what("send of " + std::to_string(bytes) + " bytes to rank " +
                                                                   std::to_string(peer)) {}
    void Wait() override {
      if (!work) return;
      comm->Run(what, [&] { comm->Wait(work); });
      work.reset();
    }
    C10dCommunicator* comm;
    c10::intrusive_ptr<c10d::Work> work;
    std::shared_ptr<std::vector<at::Tensor>> tensors;
    std::string what;
  };

  // The ready barrier's failure, on rank 0 with the ranks that had not entered it where the store can say.
  // A peer killed before it fails the barrier at once (its pairs close), maybe before a live peer appended
  // itself: so a list with ranks on it is read again a moment later.
  Error WithMissing(const Error& e) {
    if (rank_ != 0) return e;
    std::optional<std::vector<int>> missing = channel_.NotReached("ready", size_);
    if (missing && !missing->empty()) {
      std::this_thread::sleep_for(std::chrono::milliseconds(250));
      missing = channel_.NotReached("ready", size_);
    }
    if (!missing || missing->empty()) return e;
    return Error(e.kind(), "", std::string(e.what()) + " (" + RanksText(*missing) +
                                   " had not entered it: died, froze or came late)");
  }

  at::Tensor Wrap(void* data, uint64_t bytes) {
    return at::from_blob(data, {static_cast<int64_t>(bytes)}, at::TensorOptions().dtype(at::kByte).device(device_));
  }

  void Wait(const c10::intrusive_ptr<c10d::Work>& work) {
    if (!work->wait(timeout_)) {
      throw Error(ErrorKind::kCommTimeout, "", "did not complete within " + std::to_string(timeout_.count()) + " ms");
    }
  }

  // Runs one operation; any failure finishes the communicator and is re-raised in our terms.
  template <typename F>
  void Run(const std::string& what, F&& op) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (finished_) {
        throw Error(ErrorKind::kComm, "rank " + std::to_string(rank_),
                    "communicator is finished after an earlier failure (" + *finished_ + "); " + what + " refused");
      }
    }
    const std::string context = "rank " + std::to_string(rank_) + ": " + what;
    auto fail = [&](ErrorKind kind, const std::string& cause) {
      {
        std::lock_guard<std::mutex> lock(mu_);
        if (!finished_) finished_ = what + ": " + cause.substr(0, 200);
      }
      Abort();
      throw Error(kind, context, cause);
    };
    try {
      op();
    } catch (const Error& e) {
      fail(e.kind(), e.what());
    } catch (const c10::Error& e) {
      std::string m = Clean(e.what_without_backtrace());
      fail(LooksLikeTimeout(m) ? ErrorKind::kCommTimeout : ErrorKind::kComm, m);
    } catch (const std::exception& e) {
      std::string m = Clean(e.what());
      fail(LooksLikeTimeout(m) ? ErrorKind::kCommTimeout : ErrorKind::kComm, m);
    }
  }

  c10::intrusive_ptr<c10d::Backend> backend_;
  StoreChannel channel_;
  std::chrono::milliseconds timeout_;
  c10::Device device_;
  bool owns_;
  int rank_, size_;
  std::mutex mu_;
  std::optional<std::string> finished_;
  bool readying_ = false;  // in Ready: the only collective that may run is its barrier
};

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
  std::string m = Clean(e.what());
  if (auto* c = dynamic_cast<const c10::Error*>(&e)) m = Clean(c->what_without_backtrace());
  // A worker whose connection to the store broke, or never came up, has lost rank 0: the same
  // words as a rank that lost it later, mid-load.
  if (rv.rank != 0 && dynamic_cast<const c10::DistNetworkError*>(&e) != nullptr) {
    const FailureNote n = LooksLikeTimeout(m) ? StoreUnanswered(StoreHost(rv), StoreAt(rv)) : StoreLost(StoreHost(rv));
    return Error(n.kind, phase, n.message);
  }
  return Error(LooksLikeTimeout(m) ? ErrorKind::kCommTimeout : ErrorKind::kComm,
               "rank " + std::to_string(rv.rank) + " rendezvous at " + rv.master_addr + ":" +
                   std::to_string(rv.master_port),
               m);
}

namespace {

struct AgreedGroup {
  c10::intrusive_ptr<c10d::Backend> backend;
  std::string token;
  bool reused = false;  // a kept group, ready since the operation that made it
};

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
    if (decided.rfind("reuse ", 0) == 0) return {kept->backend, kept->token, /*reused=*/true};
    return {MakeGlooGroup(store, rank, world_size, timeout, master_addr, kGlooConnect),
            decided.substr(decided.find(' ') + 1)};
  };
  kept.reset();  // the lambda holds the only reference: a group not reused is torn down with it
  const std::string where = "rank " + std::to_string(rank) + ": this operation's Gloo group (" +
                            std::to_string(world_size) + " ranks, over " + store_host + ")";
  std::optional<AgreedGroup> agreed;
  try {
    agreed = WithDeadline(std::move(make), RendezvousDeadline(timeout));
  } catch (const Error& e) {
    throw Error(e.kind(), where, e.what());
  } catch (const c10::Error& e) {
    const std::string m = Clean(e.what_without_backtrace());
    throw Error(LooksLikeTimeout(m) ? ErrorKind::kCommTimeout : ErrorKind::kComm, where, m);
  } catch (const std::exception& e) {
    const std::string m = Clean(e.what());
    throw Error(LooksLikeTimeout(m) ? ErrorKind::kCommTimeout : ErrorKind::kComm, where, m);
  }
  if (!agreed) {
    throw Error(ErrorKind::kCommTimeout, where,
                "not made within " + std::to_string(RendezvousDeadline(timeout).count()) +
                    " ms: the store does not answer (the rank that hosts it died or is frozen), or a rank died "
                    "or froze while the group was made");
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
  using Made = std::pair<c10::intrusive_ptr<c10d::Backend>, c10::intrusive_ptr<c10d::Store>>;
  // The TCPStore client and gloo's rendezvous read the store with no deadline of their own: against a
  // frozen rank 0 they would wait forever. So the whole rendezvous runs under one deadline.
  std::function<Made()> make = [rv, timeout]() -> Made {
    c10d::TCPStoreOptions so;
    so.port = static_cast<uint16_t>(rv.master_port);
    so.isServer = rv.rank == 0;
    so.numWorkers = rv.world_size;
    so.waitWorkers = true;
    so.timeout = timeout;
    if (rv.rank == 0 && rv.listen_fd >= 0) so.masterListenFd = rv.listen_fd;  // bound by the launcher: no port race
    auto store = c10::make_intrusive<c10d::TCPStore>(rv.master_addr, so);
    c10::intrusive_ptr<c10d::Store> prefixed = c10::make_intrusive<c10d::PrefixStore>("shardcast", store);
    return {MakeGlooGroup(prefixed, rv.rank, rv.world_size, timeout, rv.master_addr, kGlooConnect), prefixed};
  };
  std::optional<Made> made;
  try {
    made = WithDeadline(std::move(make), RendezvousDeadline(timeout));
  } catch (const std::exception& e) {
    throw RendezvousError(rv, phase, e);
  }
  if (!made) {
    if (rv.rank != 0) {
      const FailureNote n = StoreUnanswered(StoreHost(rv), StoreAt(rv));
      throw Error(n.kind, phase, n.message);
    }
    throw Error(ErrorKind::kCommTimeout, "rank 0 rendezvous at " + rv.master_addr + ":" + std::to_string(rv.master_port),
                "did not complete within " + std::to_string(RendezvousDeadline(timeout).count()) + " ms");
  }
  auto comm = std::make_unique<C10dCommunicator>(std::move(made->first), made->second, StoreHost(rv), timeout,
                                                 c10::Device(c10::kCPU), /*owns=*/true, StoreAt(rv));
  comm->Ready(phase);
  return comm;
}

}  // namespace shardcast
