#include "allocators/commit_beside.h"

#include <fcntl.h>
#include <pthread.h>
#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>

namespace shardcast {

bool CanLeaveIdlePriority() {
  int fds[2];
  if (pipe2(fds, O_CLOEXEC) != 0) return false;
  std::thread t;
  try {
    t = std::thread([r = fds[0]] {  // ends at the write end's close, and closes its own end
      char c;
      while (read(r, &c, 1) < 0 && errno == EINTR) {
      }
      close(r);
    });
  } catch (...) {  // std::system_error: no thread
    close(fds[0]);
    close(fds[1]);
    return false;
  }
  sched_param zero{};
  const bool ok = pthread_setschedparam(t.native_handle(), SCHED_IDLE, &zero) == 0 &&
                  pthread_setschedparam(t.native_handle(), SCHED_OTHER, &zero) == 0;
  close(fds[1]);
  if (ok) {
    t.join();
  } else {
    t.detach();  // perhaps left at idle priority: it ends on its own once given a core
  }
  return ok;
}

bool MayLeaveIdlePriority() {
  static const bool may = CanLeaveIdlePriority();
  return may;
}

CommitBeside::~CommitBeside() {
  Stop();
  Join();
}

void CommitBeside::Prepare(std::vector<std::pair<unsigned char*, size_t>> pieces, int threads) {
  pieces_ = std::move(pieces);
  want_ = std::min(static_cast<size_t>(std::max(1, threads)), pieces_.size());
  threads_.reserve(want_);
}

void CommitBeside::Start() noexcept {
  if (!MayLeaveIdlePriority()) return;
  while (threads_.size() < want_) {
    try {
      threads_.emplace_back([this] { Work(); });
    } catch (...) {  // std::system_error (no thread), or std::bad_alloc (its state)
      break;
    }
    // Set here, not by the thread itself, so that Stop() (this thread too) always comes after it.
    sched_param zero{};
    pthread_setschedparam(threads_.back().native_handle(), SCHED_IDLE, &zero);
  }
}

void CommitBeside::Stop() noexcept {
  stop_.store(true, std::memory_order_relaxed);
  sched_param zero{};
  for (std::thread& t : threads_) {
    if (t.joinable()) pthread_setschedparam(t.native_handle(), SCHED_OTHER, &zero);
  }
}

void CommitBeside::Join() noexcept {
  for (std::thread& t : threads_) {
    if (t.joinable()) t.join();
  }
  threads_.clear();
}

void CommitBeside::Work() noexcept {
  pthread_setname_np(pthread_self(), "shardcast-fill");  // 15 characters at most
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  for (size_t i; !stop_.load(std::memory_order_relaxed) && (i = next_++) < pieces_.size();) {
    unsigned char* const p = pieces_[i].first;
    for (size_t at = 0; at < pieces_[i].second; at += page) {
      if (stop_.load(std::memory_order_relaxed)) return;
      // A write fault that keeps the byte: zero swapped for zero, or nothing where a reader has written
      // (its page is there already). Not an OR of zero: clang makes that a fenced load, a read fault.
      unsigned char zero = 0;
      __atomic_compare_exchange_n(p + at, &zero, static_cast<unsigned char>(0), false, __ATOMIC_RELAXED,
                                  __ATOMIC_RELAXED);
    }
  }
}

}  // namespace shardcast
