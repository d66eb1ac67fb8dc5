#include "allocators/commit_beside.h"

#include <fcntl.h>
#include <pthread.h>
#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <mutex>

namespace shardcast {

int ProbeLeaveIdlePriority() {
  int fds[2];
  if (pipe2(fds, O_CLOEXEC) != 0) return -1;
  std::thread t;
  try {
    t = std::thread([r = fds[0]] {  // alive until the write end's close; closes its own end
      char c;
      while (read(r, &c, 1) < 0 && errno == EINTR) {
      }
      close(r);
    });
  } catch (...) {  // std::system_error: no thread
    close(fds[0]);
    close(fds[1]);
    return -1;
  }
  sched_param zero{};
  const int down = pthread_setschedparam(t.native_handle(), SCHED_IDLE, &zero);
  const int up = down == 0 ? pthread_setschedparam(t.native_handle(), SCHED_OTHER, &zero) : down;
  close(fds[1]);
  if (up == 0) {
    t.join();
  } else {
    t.detach();  // perhaps left at idle priority: it ends on its own once given a core
  }
  return up == 0 ? 1 : up == EPERM ? 0 : -1;
}

bool MayLeaveIdlePriority() {
  static std::atomic<int64_t> known{0};  // the first definite answer, as pid * 2 + answer (0: none yet)
  const int64_t pid = getpid();
  const int64_t was = known.load(std::memory_order_relaxed);
  if (was / 2 == pid) return was % 2 == 1;
  const int may = ProbeLeaveIdlePriority();
  if (may >= 0) known.store(pid * 2 + may, std::memory_order_relaxed);
  return may == 1;
}

CommitBeside::~CommitBeside() {
  Stop();
  Join();
}

void CommitBeside::Prepare(std::vector<std::pair<unsigned char*, size_t>> pieces, int threads,
                           std::shared_ptr<const void> keep) {
  shared_->pieces = std::move(pieces);
  shared_->keep = std::move(keep);
  want_ = std::min(static_cast<size_t>(std::max(1, threads)), shared_->pieces.size());
  threads_.reserve(want_);
  lifted_.reserve(want_);
}

void CommitBeside::Start() noexcept {
  if (want_ == 0 || shared_->stop.load(std::memory_order_relaxed)) return;
  lifts_ = MayLeaveIdlePriority();
  if (!lifts_ && shared_->keep == nullptr) return;  // a thread let go would touch pages unmapped
  int policy = SCHED_OTHER;
  sched_param param{};
  pthread_getschedparam(pthread_self(), &policy, &param);
  lift_ = policy == SCHED_BATCH || policy == SCHED_IDLE ? policy : SCHED_OTHER;  // the caller's, not real-time
  while (threads_.size() < want_) {
    try {
      threads_.emplace_back([shared = shared_] { Work(*shared); });
    } catch (...) {  // std::system_error (no thread), or std::bad_alloc (its state)
      break;
    }
    sched_param zero{};  // the thread waits for Stop() before it ends: its handle is valid until then
    pthread_setschedparam(threads_.back().native_handle(), SCHED_IDLE, &zero);
  }
}

void CommitBeside::Stop() noexcept {
  if (shared_->stop.load(std::memory_order_relaxed)) return;
  // Lifted while every thread still waits for stop at the latest, so that no handle names a thread gone:
  // glibc reads the thread id again for the call, and a thread that ended in between would leave 0 (this
  // thread) there.
  sched_param zero{};
  lifted_.assign(threads_.size(), false);  // reserved in Prepare: no allocation here
  for (size_t i = 0; lifts_ && i < threads_.size(); ++i) {
    lifted_[i] = pthread_setschedparam(threads_[i].native_handle(), lift_, &zero) == 0;
  }
  {
    std::lock_guard<std::mutex> lock(shared_->mu);
    shared_->stop.store(true, std::memory_order_relaxed);
  }
  shared_->stopped.notify_all();
}

size_t CommitBeside::let_go() const {
  if (shared_->keep == nullptr) return 0;
  size_t n = 0;
  for (size_t i = 0; i < threads_.size() && i < lifted_.size(); ++i) n += threads_[i].joinable() && !lifted_[i];
  return n;
}

void CommitBeside::Join() noexcept {
  for (size_t i = 0; i < threads_.size(); ++i) {
    if (!threads_[i].joinable()) continue;
    if ((i < lifted_.size() && lifted_[i]) || shared_->keep == nullptr) {
      threads_[i].join();
    } else {
      threads_[i].detach();  // ends at its next page once given a core; `keep` keeps the pieces mapped till then
    }
  }
  threads_.clear();
}

void CommitBeside::Work(Shared& s) noexcept {
  pthread_setname_np(pthread_self(), "shardcast-fill");  // 15 characters at most
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  for (size_t i; !s.stop.load(std::memory_order_relaxed) && (i = s.next++) < s.pieces.size();) {
    auto* const p = static_cast<volatile unsigned char*>(s.pieces[i].first);
    for (size_t at = 0; at < s.pieces[i].second && !s.stop.load(std::memory_order_relaxed); at += page) {
      // A write fault that keeps the byte: zero swapped for zero, or nothing where a reader has written
      // (its page is there already). Not an OR of zero: clang makes that a fenced load, a read fault.
      unsigned char zero = 0;
      __atomic_compare_exchange_n(p + at, &zero, static_cast<unsigned char>(0), false, __ATOMIC_RELAXED,
                                  __ATOMIC_RELAXED);
    }
  }
  std::unique_lock<std::mutex> lock(s.mu);
  s.stopped.wait(lock, [&s] { return s.stop.load(std::memory_order_relaxed); });
}

}  // namespace shardcast
