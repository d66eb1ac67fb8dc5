// runtime/comm/store_channel: the failure side channel over a c10d Store, where every operation has a
// deadline, on the failure path too.
//
// c10d's TCPStore client can block forever when its server process is frozen (SIGSTOP, a hung node):
// the connection stays open and nothing answers. So the channel's store operations run, in order, on
// one worker thread of its own, and the caller waits at most `op_deadline` for each; a late operation
// leaves the worker blocked (it holds its own reference to the store) and marks the store
// unreachable, so later calls fail at once instead of queueing behind it. A store that refuses or
// drops the connection is marked lost. Either way, every rank gets the same note naming the store's
// host.
//
// Thread safety: one thread at a time. Failure: never throws; results are values.
#pragma once

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <future>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "runtime/agree/communicator.h"

namespace shardcast {

// One thread that runs submitted operations in order, each awaited with a deadline. A late operation
// keeps the thread; the owner must then stop submitting. Destroying the worker detaches the thread,
// which ends once its current operation returns (or with the process, if it never does): everything
// it touches is shared with it, not owned by the worker.
class DeadlineWorker {
 public:
  DeadlineWorker();
  ~DeadlineWorker();
  DeadlineWorker(const DeadlineWorker&) = delete;
  DeadlineWorker& operator=(const DeadlineWorker&) = delete;

  // Runs task after those submitted before, awaited by no one: its exception is dropped.
  void Post(std::function<void()> task);

  // op's value, or its exception rethrown, or nullopt when it did not finish within `deadline`.
  template <typename T>
  std::optional<T> Run(std::function<T()> op, std::chrono::milliseconds deadline) {
    auto task = std::make_shared<std::packaged_task<T()>>(std::move(op));
    std::future<T> done = task->get_future();
    Submit([task] { (*task)(); });
    if (done.wait_for(deadline) != std::future_status::ready) return std::nullopt;
    return done.get();
  }

 private:
  struct Queue {
    std::mutex mu;
    std::condition_variable cv;
    std::deque<std::function<void()>> tasks;
    bool stop = false;
  };
  void Submit(std::function<void()> task);
  std::shared_ptr<Queue> q_;
};

class StoreChannel {
 public:
  // host: who serves the store, for messages ("rank 0 (the store host at 10.0.0.1:29500)"); at: where it
  // listens, resolved here (Resolved) and probed when an operation is late (StoreUnanswered).
  StoreChannel(c10::intrusive_ptr<c10d::Store> store, std::string host, StoreAddress at = {},
               std::chrono::milliseconds op_deadline = std::chrono::milliseconds(3000));
  bool usable() const { return static_cast<bool>(store_); }

  // Publishes `mine` unless a failure is already published; returns the one that stands, or the
  // store's loss.
  std::optional<FailureNote> Publish(const FailureNote& mine);
  // The published failure within `wait`, the store's loss, or nullopt when nothing came in time.
  std::optional<FailureNote> Fetch(std::chrono::milliseconds wait);
  // Whether a failure is published (one check, taking nothing); false where the store cannot say.
  bool Published();
  // Waits until `n` ranks fetched, or `wait` passed, or the store is gone.
  void AwaitAcks(int n, std::chrono::milliseconds wait);

  // Who reached a step, for the error of a collective that never ends: `Reach` adds this rank to the step's
  // list (one append), `NotReached` reads which ranks of [0, world_size) are not on it (one read); nullopt
  // where the store cannot say. A store that fails or is late here is the channel's loss, as above.
  // `times`: a step a rank reaches again and again (each of an operation's agreement collectives) is on
  // the list once a time; NotReached names the ranks on it fewer than `times` times. ReachLater queues the
  // append on the channel's worker, in order with its other calls, and returns at once: for a step on the
  // way into every collective, which a store round trip would make slower.
  void Reach(const std::string& step, int rank);
  void ReachLater(const std::string& step, int rank);
  std::optional<std::vector<int>> NotReached(const std::string& step, int world_size, int times = 1);

 private:
  // Runs op on the worker; nullopt (and loss_ set) when it failed or missed the deadline. The result
  // lives in the future's shared state, so a late operation writes nothing of ours.
  template <typename T>
  std::optional<T> Call(std::function<T(c10d::Store&)> op);

  c10::intrusive_ptr<c10d::Store> store_;
  std::string host_;
  StoreAddress at_;
  std::chrono::milliseconds deadline_;
  std::optional<FailureNote> loss_;
  std::unique_ptr<DeadlineWorker> worker_;  // made at the first call: a channel never used has no thread
};

// How many times each rank of [0, world_size) is on `list`, the text ranks append themselves to
// ("0 2 1 0 "); anything else in it is passed over.
std::vector<int> TimesOn(const std::string& list, int world_size);

// Runs `op` on a thread of its own and waits at most `deadline`: its value, or its exception rethrown,
// or nullopt when it is late. A late thread is abandoned, so `op` must own (by value or reference
// count) everything it touches. For one-off calls (a rendezvous); a channel's many calls share a
// DeadlineWorker.
template <typename T>
std::optional<T> WithDeadline(std::function<T()> op, std::chrono::milliseconds deadline) {
  auto task = std::make_shared<std::packaged_task<T()>>(std::move(op));
  std::future<T> done = task->get_future();
  std::thread([task] { (*task)(); }).detach();
  if (done.wait_for(deadline) != std::future_status::ready) return std::nullopt;
  return done.get();
}

// WithDeadline, asking `stop` every `every` while `op` runs: nullopt at once where it says yes (`*stopped`
// set; `op`'s thread is abandoned as a late one is). `stop` must bound its own wait.
template <typename T>
std::optional<T> WithDeadlineUnless(std::function<T()> op, std::chrono::milliseconds deadline,
                                    const std::function<bool()>& stop, std::chrono::milliseconds every,
                                    bool* stopped) {
  *stopped = false;
  auto task = std::make_shared<std::packaged_task<T()>>(std::move(op));
  std::future<T> done = task->get_future();
  std::thread([task] { (*task)(); }).detach();
  const auto until = std::chrono::steady_clock::now() + deadline;
  for (;;) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(until - std::chrono::steady_clock::now());
    if (done.wait_for(std::max(std::chrono::milliseconds(0), std::min(left, every))) == std::future_status::ready) {
      return done.get();
    }
    if (std::chrono::steady_clock::now() >= until) return std::nullopt;
    if (stop()) {
      *stopped = true;
      return std::nullopt;
    }
  }
}

// The two ways a store host fails, worded once so every survivor raises the same kind and message
// whatever its own socket saw (a reset, a closed connection, a late reply).
FailureNote StoreSilent(const std::string& host);  // kCommTimeout: frozen or unreachable
FailureNote StoreLost(const std::string& host);    // kComm: its process or node went away

// `at` with its name resolved to numeric addresses (at.numeric), within 3 x wait; `at` as it was where that
// fails or is late (its name is then resolved when probed). An address is its own; a name is looked up once
// a process (the first channel over it, while the store answers; every later one takes the same addresses).
// A late call's probe then connects to those addresses alone, so that no rank's name service, slow or
// failing once the store's host is gone, turns its "lost" into "silent", and the ranks of a failing job do
// not all ask it at once. Nothing is known (an empty StoreAddress) only where no memory was left.
StoreAddress Resolved(const StoreAddress& at, std::chrono::milliseconds wait = std::chrono::milliseconds(500)) noexcept;

// Whether a TCP connection to `at` is refused within `wait`: on some address it has (at.numeric, else the
// addresses this process resolved the name to before, else the name's), and no other one accepted or stayed
// silent (an address this machine cannot use, such as ::1 with IPv6 off, is passed over). Then the host is up
// and nothing listens on the port: the store's process is gone. False where one is accepted, or not answered
// in time, or `at` is not known, or the probe itself cannot run. The whole probe, resolving the name
// included, is bounded by 3 x wait.
bool StoreRefuses(const StoreAddress& at, std::chrono::milliseconds wait = std::chrono::milliseconds(500)) noexcept;

// The note for a store that did not answer in time: lost where its port refuses a connection, else silent.
// A late answer alone does not tell a dead host from a frozen one: a rank whose call was already waiting
// when the host died, or that came after it (its connect retried until the deadline), would call it silent
// where a rank whose socket saw the close calls it lost. The port settles it the same way on every rank.
FailureNote StoreUnanswered(const std::string& host, const StoreAddress& at);

// "<kind>|<message>" and back; a malformed value becomes a kComm note quoting it.
std::string EncodeFailure(const FailureNote& note);
FailureNote DecodeFailure(const std::string& value);

}  // namespace shardcast
