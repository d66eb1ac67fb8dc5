#include "runtime/comm/c10d_backend.h"

#include <ATen/ops/from_blob.h>
#include <torch/version.h>

#include <algorithm>
#include <functional>
#include <iterator>
#include <thread>

#include "allocators/error.h"
#include "runtime/agree/failure.h"
#include "runtime/agree/fault.h"
#include "runtime/agree/verdict.h"
#include "runtime/comm/gloo_groups.h"

namespace shardcast {

std::string CleanC10dMessage(const std::string& m) {
  std::string s = m.substr(0, m.find('\n'));
  size_t advice = s.find(" This is typically caused");
  if (advice != std::string::npos) s = s.substr(0, advice);
  if (s.rfind("[", 0) == 0 && s.find("] ") != std::string::npos) s = s.substr(s.find("] ") + 2);
  return s;
}

C10dCommunicator::C10dCommunicator(c10::intrusive_ptr<c10d::Backend> backend, c10::intrusive_ptr<c10d::Store> store,
                                   std::string store_host, std::chrono::milliseconds timeout, c10::Device device,
                                   bool owns, StoreAddress store_at)
    : backend_(std::move(backend)), channel_(std::move(store), std::move(store_host), std::move(store_at)),
      timeout_(timeout), device_(device), owns_(owns), rank_(backend_->getRank()), size_(backend_->getSize()) {}

// Runs one operation; any failure finishes the communicator and is re-raised in our terms.
template <typename F>
void C10dCommunicator::Run(const std::string& what, F&& op) {
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
    std::string m = CleanC10dMessage(e.what_without_backtrace());
    fail(LooksLikeTimeout(m) ? ErrorKind::kCommTimeout : ErrorKind::kComm, m);
  } catch (const std::exception& e) {
    std::string m = CleanC10dMessage(e.what());
    fail(LooksLikeTimeout(m) ? ErrorKind::kCommTimeout : ErrorKind::kComm, m);
  }
}

// A collective that times out says nothing of who is missing: a rank frozen between the stream and the
// verdict left every survivor with "rank 0: all-reduce of 6 values: Operation timed out!". So each rank
// appends itself to the store's list on the way into each agreement collective (queued on the channel's
// worker, not awaited: no round trip on the collective's path), and a rank whose collective failed names the
// ranks whose entries fall short, less those that came to the failure agreement (alive: they failed
// elsewhere). Every rank words its own note so: the one that stands is rank 0's, or, where rank 0's came
// late, the first other rank's. The stream's broadcasts are not counted: one append per message and rank
// would be the store's load at scale; a stream step's failure names its peer already.
template <typename F>
void C10dCommunicator::RunCounted(const std::string& what, const char* which, F&& op) {
  const int times = ++counted_;
  channel_.ReachLater(kCollectiveStep, rank_);
  try {
    Run(what, std::forward<F>(op));
  } catch (const Error& e) {
    throw WithAbsentFromCollective(channel_, e, size_, times, std::string("this ") + which);
  }
}

// The operation's sends: each keeps its tensor (and so the caller's bytes' wrapper) until waited for or gone.
struct C10dCommunicator::Pending : PendingSend {
  Pending(C10dCommunicator* c, c10::intrusive_ptr<c10d::Work> w, std::shared_ptr<std::vector<at::Tensor>> t, int peer,
          uint64_t bytes)
      : comm(c),
        work(std::move(w)),
        tensors(std::move(t)),
        what("send of " + std::to_string(bytes) + " bytes to rank " + std::to_string(peer)) {}
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

c10::intrusive_ptr<c10d::Backend> C10dCommunicator::Release() {
  std::lock_guard<std::mutex> lock(mu_);
  if (finished_ || !owns_ || token.empty()) return {};
  finished_ = "kept for the next operation";
  return std::move(backend_);
}

void C10dCommunicator::Broadcast(void* data, uint64_t bytes, int root) {
  if (bytes == 0) return;
  Run("broadcast of " + std::to_string(bytes) + " bytes from rank " + std::to_string(root), [&] {
    std::vector<at::Tensor> t = {Wrap(data, bytes)};
    c10d::BroadcastOptions o;
    o.rootRank = root;
    o.timeout = timeout_;
    Wait(backend_->broadcast(t, o));
  });
}

std::unique_ptr<PendingSend> C10dCommunicator::SendAsync(const void* data, uint64_t bytes, int peer) {
  std::unique_ptr<PendingSend> out;
  Run("send of " + std::to_string(bytes) + " bytes to rank " + std::to_string(peer), [&] {
    auto tensors = std::make_shared<std::vector<at::Tensor>>(1, Wrap(const_cast<void*>(data), bytes));
    out = std::make_unique<Pending>(this, backend_->send(*tensors, peer, /*tag=*/0), tensors, peer, bytes);
  });
  return out;
}

void C10dCommunicator::Recv(void* data, uint64_t bytes, int peer) {
  if (bytes == 0) return;
  Run("receive of " + std::to_string(bytes) + " bytes from rank " + std::to_string(peer), [&] {
    std::vector<at::Tensor> t = {Wrap(data, bytes)};
    Wait(backend_->recv(t, peer, /*tag=*/0));
  });
}

void C10dCommunicator::AllReduceSum(int64_t* values, uint64_t count) {
  RunCounted("all-reduce of " + std::to_string(count) + " values", "all-reduce", [&] {
    std::vector<at::Tensor> t = {at::from_blob(values, {static_cast<int64_t>(count)}, at::kLong)};
    c10d::AllreduceOptions o;
    o.reduceOp = c10d::ReduceOp::SUM;
    o.timeout = timeout_;
    Wait(backend_->allreduce(t, o));
  });
}

void C10dCommunicator::Barrier() {
  RunCounted("barrier", "barrier", [&] { WaitBarrier(); });
}

void C10dCommunicator::BarrierAs(const std::string& what) {
  Run(what, [&] { WaitBarrier(); });
}

void C10dCommunicator::WaitBarrier() {
  c10d::BarrierOptions o;
  o.timeout = timeout_;
  Wait(backend_->barrier(o));
}

// Readies a group just made (MakeGlooGroup) on every rank with its first collective, a barrier: no rank
// goes on while a peer still makes its own group, so a fast rank's failure in the operation cannot hit a
// peer that is still making it. (A rank that dies or freezes between its group and the barrier can: the
// peer's making fails, and agrees with the others, FailMakingTogether in c10d_communicator.cc.) But a barrier tells a rank only that every rank entered it, not that every rank
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
// those that came to the group (kArrivedStep) first, and rank 0 (whose failure note every rank raises, as it
// hosts the store) names the ranks not on the list: they died or froze before it. One append a rank on the
// way in, one read only on failure. A rank whose making of the group failed (a peer died as it connected)
// adds itself too, and agrees on the same note (c10d_communicator.cc, FailMakingTogether).
void C10dCommunicator::Ready(const char* phase) {
  readying_ = true;
  try {
    FaultPoint("group", rank_);
    channel_.Reach(kArrivedStep, rank_);
    try {
      BarrierAs("the barrier that readies this operation's Gloo group (" + std::to_string(size_) + " ranks)");
    } catch (const Error& e) {
      throw WithAbsentFromGroup(channel_, e, rank_, size_);
    }
  } catch (const std::exception& e) {
    FailTogether(*this, e, phase);
  }
  readying_ = false;
}

void C10dCommunicator::Abort() {
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

namespace {

// The ranks short of `times` on `step`'s list, less (where `failing_alive`) those on kFailingStep's; nullopt
// where the store cannot say.
std::optional<std::vector<int>> Absent(StoreChannel& channel, int world_size, const char* step, int times,
                                       bool failing_alive) {
  std::optional<std::vector<int>> missing = channel.NotReached(step, world_size, times);
  if (!missing || missing->empty() || !failing_alive) return missing;
  const std::optional<std::vector<int>> not_failing = channel.NotReached(kFailingStep, world_size);
  if (!not_failing) return missing;
  std::vector<int> absent;
  std::set_intersection(missing->begin(), missing->end(), not_failing->begin(), not_failing->end(),
                        std::back_inserter(absent));
  return absent;
}

Error WithAbsent(StoreChannel& channel, const Error& e, int world_size, const char* step, int times,
                 const std::string& what, bool failing_alive) {
  std::optional<std::vector<int>> missing = Absent(channel, world_size, step, times, failing_alive);
  if (missing && !missing->empty()) {
    std::this_thread::sleep_for(std::chrono::milliseconds(250));
    missing = Absent(channel, world_size, step, times, failing_alive);
  }
  if (!missing || missing->empty()) return e;
  return Error(e.kind(), "", std::string(e.what()) + " (" + RanksText(*missing) + " never came to " + what +
                                 ": died, froze or came late)");
}

}  // namespace

Error WithAbsentFromGroup(StoreChannel& channel, const Error& e, int rank, int world_size) {
  if (rank != 0) return e;
  return WithAbsent(channel, e, world_size, kArrivedStep, 1, "the group", /*failing_alive=*/false);
}

Error WithAbsentFromCollective(StoreChannel& channel, const Error& e, int world_size, int times,
                               const std::string& what) {
  return WithAbsent(channel, e, world_size, kCollectiveStep, times, what, /*failing_alive=*/true);
}

at::Tensor C10dCommunicator::Wrap(void* data, uint64_t bytes) {
  return at::from_blob(data, {static_cast<int64_t>(bytes)}, at::TensorOptions().dtype(at::kByte).device(device_));
}

void C10dCommunicator::Wait(const c10::intrusive_ptr<c10d::Work>& work) {
  if (!work->wait(timeout_)) {
    throw Error(ErrorKind::kCommTimeout, "", "did not complete within " + std::to_string(timeout_.count()) + " ms");
  }
}

}  // namespace shardcast
