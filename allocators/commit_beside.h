// allocators/commit_beside: commits fresh memory on threads of idle priority while another part of the
// process is about to write it (a load's readers): they take only the CPU the writers leave idle.
//
// Each page is committed by touching it for writing (an atomic compare-and-swap of zero for zero on one
// byte, so a byte another thread wrote is kept). Such a fault takes only its mapping's own lock. MADV_POPULATE_WRITE would
// commit a batch faster but holds the process's memory-map lock while it runs: an idle-priority thread
// descheduled inside it (the cores busy with other work) blocks every thread that needs that lock after a
// waiting mmap or munmap, the readers' own populates included. On the 2-core dev VM with two spinning
// processes beside one rank's load (1.91 GB), the load took 1.75-2.1 s with the populate against 0.94-1.2
// s with no commit beside at all; with the touch, the stream itself is not slowed (bench/RESULTS.md).
//
// The threads run at SCHED_IDLE from Start() on, and Stop() asks them back to the normal priority, so that
// a thread starved by the cores' other work ends at once instead of whenever it is given a core again
// (Join() must wait for it: it touches the pieces). The kernel lets a thread leave SCHED_IDLE only with
// CAP_SYS_NICE or an RLIMIT_NICE of 20 or more (root on a bare host, not a default container). Where this
// process may not (MayLeaveIdlePriority), Start() starts no thread: the writers commit the pages they reach,
// as they would behind a commit they overtook. Measured on the 2-core VM with two spinning processes beside
// one rank's load: 1.12 s with the commit stopped this way, 1.94 s with threads left at idle priority, 1.11
// s with none (medians of 5 interleaved rounds).
//
// Thread safety: Prepare, Start, Stop and Join are called from one thread (the owner's). REQUIRES: the
// pieces stay mapped until Join() (or the destructor) returns.
#pragma once

#include <atomic>
#include <cstddef>
#include <thread>
#include <utility>
#include <vector>

namespace shardcast {

// Whether this process may take a thread of its own out of SCHED_IDLE again, tried now on a thread made for
// it; MayLeaveIdlePriority() is its first answer, remembered.
bool CanLeaveIdlePriority();
bool MayLeaveIdlePriority();

class CommitBeside {
 public:
  CommitBeside() = default;
  CommitBeside(const CommitBeside&) = delete;
  CommitBeside& operator=(const CommitBeside&) = delete;
  ~CommitBeside();  // Stop(), then Join()

  // Takes `pieces` (address, bytes) to commit in order with up to `threads` threads, and the room for them.
  // Throws only std::bad_alloc.
  void Prepare(std::vector<std::pair<unsigned char*, size_t>> pieces, int threads);

  // Starts the commit, where MayLeaveIdlePriority(). Never throws: where no thread can be had, those
  // running do the rest, and where none runs the pages are committed by whoever writes them first.
  void Start() noexcept;

  // Ends the commit at each thread's next page, and asks its threads back to the normal priority.
  void Stop() noexcept;

  // Waits for the commit's threads to end (at once where none started).
  void Join() noexcept;

  // How many threads Start() started (0 before it).
  size_t threads() const { return threads_.size(); }

 private:
  void Work() noexcept;

  std::vector<std::pair<unsigned char*, size_t>> pieces_;
  size_t want_ = 0;  // threads to start
  std::atomic<size_t> next_{0};
  std::atomic<bool> stop_{false};
  std::vector<std::thread> threads_;
};

}  // namespace shardcast
