// allocators/commit_beside: commits fresh memory on threads of idle priority while another part of the
// process is about to write it (a load's readers): they take only the CPU the writers leave idle.
//
// Each page is committed by touching it for writing: an atomic compare-and-swap of zero for zero on one
// byte, so a byte another thread wrote is kept. On Linux 6.4 and later such a fault takes only its
// mapping's own lock (earlier kernels take the process's memory-map lock for reading, as below).
// MADV_POPULATE_WRITE commits a batch faster but holds the memory-map lock while it runs: an idle-priority
// thread descheduled inside it (the cores busy with other work) stalls every thread that needs the lock
// behind a waiting mmap or munmap, the readers' own populates included.
//
// The threads run at SCHED_IDLE from Start() on, and Stop() lifts them back to the caller's priority, so a
// thread starved by the cores' other work ends at once instead of whenever it is next given a core
// (where Join() must wait for it: it touches the pieces). The kernel lets a thread leave SCHED_IDLE only with
// CAP_SYS_NICE or an RLIMIT_NICE of 20 or more (`ulimit -e 20`, or "nice" in limits.conf; root on a bare
// host, not a default container's). Where this process may not (MayLeaveIdlePriority), or a lift fails
// (the privilege dropped since it was asked), a thread is not waited for: Join() lets it go, holding `keep`
// (what keeps every piece mapped: all of them, until the last such thread ends) until it next gets a core,
// sees Stop() and ends. Without a `keep`, Start() starts no thread where the process may not lift them:
// the writers commit the pages they reach themselves.
//
// Measured on the 2-core dev VM, one rank loading 1.91 GB beside two spinning processes (medians of 5
// interleaved rounds, bench/RESULTS.md "The commit beside the stream on a busy node"): 1.12 s, against
// 1.94 s with the threads left idle at the end and joined, and 1.11 s with no commit; the populate at idle
// priority took 2.12 and 1.75 s (two runs) where no commit took 1.23 and 1.11 s. Without the privilege
// (threads let go at the end; "Threads let go where they cannot be lifted"): a cold load into a meta model
// 1.59 s against 1.83 s with no commit.
//
// Thread safety: Prepare, Start, Stop and Join are called from one thread (the owner's). REQUIRES: the
// pieces stay mapped until Join() (or the destructor) returns, and after it as long as `keep` lives.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <memory>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

namespace shardcast {

// Whether this process may take a thread of its own out of SCHED_IDLE again: the first definite answer of
// ProbeLeaveIdlePriority, remembered (by this process: a forked child, which may have dropped the
// privilege, asks again).
bool MayLeaveIdlePriority();
// Tries it now on a thread made for it: 1 yes, 0 no (EPERM), -1 not known (no thread or pipe to try with).
int ProbeLeaveIdlePriority();

class CommitBeside {
 public:
  CommitBeside() : shared_(std::make_shared<Shared>()) {}  // throws only std::bad_alloc
  CommitBeside(const CommitBeside&) = delete;
  CommitBeside& operator=(const CommitBeside&) = delete;
  ~CommitBeside();  // Stop(), then Join()

  // Takes `pieces` (address, bytes) to commit in order with up to `threads` threads, and the room for them;
  // `keep` (may be null) keeps them mapped for threads that outlive Join(). Throws only std::bad_alloc.
  void Prepare(std::vector<std::pair<unsigned char*, size_t>> pieces, int threads,
               std::shared_ptr<const void> keep = nullptr);

  // Starts the commit, where MayLeaveIdlePriority() or a `keep` was given, and Stop() has not come first.
  // Never throws: where no thread can be had, those running do the rest, and where none runs the writers
  // commit their pages.
  void Start() noexcept;

  // Lifts the threads' priority (where this process may), then ends the commit at each thread's next page.
  // Once only; later calls do nothing.
  void Stop() noexcept;

  // Waits for the commit's threads to end (at once where none started), or, where a thread's priority could
  // not be lifted and a `keep` was given, lets it go (it holds `keep` until it ends). REQUIRES: Stop() first,
  // or the threads that ran out of pieces wait for it.
  void Join() noexcept;

  // How many threads Start() started and Join() has not joined or let go.
  size_t threads() const { return threads_.size(); }

  // How many of those Join() will let go rather than wait for: Stop() could not lift them, and a `keep` was
  // given (0 before Stop()).
  size_t let_go() const;

 private:
  // What the threads share, theirs as long as any runs: a thread let go may outlive this object.
  struct Shared {
    std::vector<std::pair<unsigned char*, size_t>> pieces;
    std::shared_ptr<const void> keep;
    std::atomic<size_t> next{0};
    std::atomic<bool> stop{false};  // set under mu: the threads wait on it, with stopped, before they end
    std::mutex mu;
    std::condition_variable stopped;
  };
  static void Work(Shared& shared) noexcept;

  std::shared_ptr<Shared> shared_;
  std::vector<bool> lifted_;  // per thread: Stop() put it back at lift_ (else, with a keep, Join() lets it go)
  size_t want_ = 0;     // threads to start
  bool lifts_ = false;  // whether Stop() lifts the threads (and Join() waits for them)
  int lift_ = 0;        // the policy Stop() puts the threads back at: the caller's of Start(), or SCHED_OTHER
  std::vector<std::thread> threads_;
};

}  // namespace shardcast
