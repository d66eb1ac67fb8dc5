// runtime/comm/c10d_backend: the Communicator over a c10d Backend, internal to runtime/comm. Its factories
// (runtime/comm/c10d_communicator.h: CreateGlooCommunicator, CreateGlooCommunicatorOnStore, WrapC10dBackend)
// are the public door; this header is theirs alone.
//
// Every operation runs under the communicator's timeout; the first failure finishes it (Abort where it owns
// the backend) and every later operation is refused, naming that failure. Failures are re-raised as
// shardcast Errors (kCommTimeout for what looks like a timeout, else kComm), naming the rank and operation.
// Thread safety: as every Communicator's (runtime/agree/communicator.h: one thread drives it); whether it is
// finished, and why, is kept under a mutex.
#pragma once

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "runtime/agree/communicator.h"
#include "runtime/comm/store_channel.h"

namespace shardcast {

// The first line of a c10d/gloo message, without gloo's advice and source location.
std::string CleanC10dMessage(const std::string& m);

// The store's list of the ranks that came to an operation's Gloo group alive: each appends itself as its group
// is made (before the barrier that readies it) or as making it fails. A rank not on it died or froze before.
inline constexpr const char* kArrivedStep = "ready";

// The store's list of the ranks that came to each of an operation's agreement collectives (its all-reduces and
// barriers, not the stream's messages): a rank appends itself on the way into each, so the k-th finds each
// live rank on it k times.
inline constexpr const char* kCollectiveStep = "collectives";

// The store's list of the ranks that came to the failure agreement to take the published note (FetchFailure):
// alive, whatever they were doing when they failed.
inline constexpr const char* kFailingStep = "failing";

// `e` on rank 0, with the ranks not on kArrivedStep's list added where the store can say; `e` elsewhere. A peer
// killed just before fails the others at once (its pairs close), maybe before a live peer appended itself: so
// a list with ranks on it is read again a moment later.
Error WithAbsentFromGroup(StoreChannel& channel, const Error& e, int rank, int world_size);

// The same for the `times`-th agreement collective, `what` ("this all-reduce"), on every rank (the note that
// stands may be any rank's, where rank 0's came late): the ranks on kCollectiveStep's list fewer than `times`
// times, less those on kFailingStep's. A rank killed mid-stream fails rank 0 in the barrier after it, while
// live ranks still stream: they never come to the barrier, but rank 0's abort fails them within
// milliseconds, and they come to the failure agreement instead.
Error WithAbsentFromCollective(StoreChannel& channel, const Error& e, int world_size, int times,
                               const std::string& what);

class C10dCommunicator : public Communicator {
 public:
  // store_host: who serves `store`, for the messages of a store that stops answering; store_at: where it
  // listens, where known (the store a Rendezvous makes). owns: the backend is this operation's (Abort
  // aborts it) rather than the caller's.
  C10dCommunicator(c10::intrusive_ptr<c10d::Backend> backend, c10::intrusive_ptr<c10d::Store> store,
                   std::string store_host, std::chrono::milliseconds timeout, c10::Device device, bool owns,
                   StoreAddress store_at = {});
  ~C10dCommunicator() override = default;

  std::optional<FailureNote> PublishFailure(const FailureNote& mine) override { return channel_.Publish(mine); }
  std::optional<FailureNote> FetchFailure(std::chrono::milliseconds wait) override {
    channel_.ReachLater(kFailingStep, rank_);
    return channel_.Fetch(wait);
  }
  void AwaitFailureAcks(int n, std::chrono::milliseconds wait) override { channel_.AwaitAcks(n, wait); }

  // The Gloo group's identity between operations (KeepGlooGroup): its token, agreed by every rank, and
  // the store its operations' prefixes share; an empty token for a group not to be kept.
  std::string token;
  const c10d::Store* group = nullptr;

  // The backend, for the next operation, where this one owns it and finished well; else null.
  c10::intrusive_ptr<c10d::Backend> Release();

  int rank() const override { return rank_; }
  int world_size() const override { return size_; }
  std::string backend() const override { return backend_ ? backend_->getBackendName() : "finished"; }
  std::chrono::milliseconds timeout() const override { return timeout_; }

  void Broadcast(void* data, uint64_t bytes, int root) override;
  std::unique_ptr<PendingSend> SendAsync(const void* data, uint64_t bytes, int peer) override;
  void Recv(void* data, uint64_t bytes, int peer) override;
  void AllReduceSum(int64_t* values, uint64_t count) override;
  void Barrier() override;
  // A barrier named `what`, not counted among the agreement's collectives (Ready's).
  void BarrierAs(const std::string& what);

  // Readies a group just made (MakeGlooGroup) on every rank with its first collective, a barrier, under the
  // failure agreement of `phase`: a rank that fails in it raises what every rank raises (c10d_backend.cc).
  void Ready(const char* phase);

  void Abort() override;

 private:
  struct Pending;

  at::Tensor Wrap(void* data, uint64_t bytes);
  void Wait(const c10::intrusive_ptr<c10d::Work>& work);
  void WaitBarrier();
  // Runs one operation; any failure finishes the communicator and is re-raised in our terms.
  template <typename F>
  void Run(const std::string& what, F&& op);
  // Run for an agreement collective, `which` ("all-reduce"): this rank goes on kCollectiveStep's list first,
  // and rank 0's failure in it names the ranks that never came to it.
  template <typename F>
  void RunCounted(const std::string& what, const char* which, F&& op);

  c10::intrusive_ptr<c10d::Backend> backend_;
  StoreChannel channel_;
  std::chrono::milliseconds timeout_;
  c10::Device device_;
  bool owns_;
  int rank_, size_;
  std::mutex mu_;
  std::optional<std::string> finished_;
  bool readying_ = false;  // in Ready: the only collective that may run is its barrier
  int counted_ = 0;        // agreement collectives entered (RunCounted)
};

}  // namespace shardcast
