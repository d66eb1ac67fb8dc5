#include "allocators/commit_beside.h"

#include <dirent.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <linux/capability.h>
#include <linux/userfaultfd.h>
#include <poll.h>
#include <signal.h>
#include <sched.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "allocators/lazy_zero.h"

namespace shardcast {
namespace {

const size_t kPage = static_cast<size_t>(sysconf(_SC_PAGESIZE));

// Which of the `pages` pages from `p` hold a page of this process's own (/proc/self/pagemap: present, and
// mapped here alone): what a write fault leaves, and a read fault's shared zero page does not.
std::vector<bool> Written(const void* p, size_t pages) {
  std::vector<bool> out(pages);
  const int fd = open("/proc/self/pagemap", O_RDONLY | O_CLOEXEC);
  EXPECT_GE(fd, 0);
  if (fd < 0) return out;
  std::vector<uint64_t> entries(pages);
  const off_t at = static_cast<off_t>(reinterpret_cast<uintptr_t>(p) / kPage * sizeof(uint64_t));
  EXPECT_EQ(pread(fd, entries.data(), pages * sizeof(uint64_t), at), static_cast<ssize_t>(pages * sizeof(uint64_t)));
  close(fd);
  for (size_t i = 0; i < pages; ++i) out[i] = (entries[i] >> 63 & 1) && (entries[i] >> 56 & 1);
  return out;
}

bool AllWritten(const void* p, size_t pages) {
  std::vector<bool> w = Written(p, pages);
  return std::all_of(w.begin(), w.end(), [](bool b) { return b; });
}

// The thread ids of this process's threads named `name`.
std::vector<pid_t> ThreadsNamed(const std::string& name) {
  std::vector<pid_t> out;
  DIR* d = opendir("/proc/self/task");
  if (d == nullptr) return out;
  while (dirent* e = readdir(d)) {
    if (e->d_name[0] == '.') continue;
    std::ifstream comm(std::string("/proc/self/task/") + e->d_name + "/comm");
    std::string line;
    if (std::getline(comm, line) && line == name) out.push_back(static_cast<pid_t>(std::stol(e->d_name)));
  }
  closedir(d);
  return out;
}

// Runs `body` in a forked child without CAP_SYS_NICE and with an RLIMIT_NICE of 0 (a user's process, a
// default container): its exit code, 2 where the child could not drop them, -1 where it died, and -2 where
// it ran past 120 s (killed: a body that hangs fails its test instead of hanging it).
template <typename Body>
int Unprivileged(Body body) {
  const pid_t child = fork();
  if (child < 0) return -1;
  if (child == 0) {
    rlimit none{0, 0};
    if (setrlimit(RLIMIT_NICE, &none) != 0) _exit(2);
    __user_cap_header_struct header{_LINUX_CAPABILITY_VERSION_3, 0};
    __user_cap_data_struct caps[2]{};
    if (syscall(SYS_capget, &header, caps) != 0) _exit(2);
    caps[0].effective &= ~(1u << CAP_SYS_NICE);
    if (syscall(SYS_capset, &header, caps) != 0) _exit(2);
    _exit(body());
  }
  int status = 0;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(120);
  pid_t done = 0;
  while ((done = waitpid(child, &status, WNOHANG)) == 0 && std::chrono::steady_clock::now() < deadline) usleep(10000);
  if (done == 0) {
    kill(child, SIGKILL);
    waitpid(child, &status, 0);
    return -2;
  }
  if (done != child || !WIFEXITED(status)) return -1;
  return WEXITSTATUS(status);
}

// Every page of every piece is committed by a write, and the bytes written before the commit are kept
// where it touches them (each piece's first byte, then one a page further on): a touch that stored a zero
// would wipe what a reader had written there.
TEST(CommitBeside, CommitsEveryPageOfItsPiecesForWritingAndKeepsTheirBytes) {
  const size_t pages = 64;
  auto* p = static_cast<unsigned char*>(LazyZeroAllocate(pages * kPage));
  // Freed once the test and every thread let go are done with it (where this process may not lift them).
  const size_t bytes = pages * kPage;
  std::shared_ptr<unsigned char> keep(p, [bytes](unsigned char* q) { LazyZeroFree(q, bytes); });
  const auto mark = [](size_t i, size_t at) { return static_cast<unsigned char>(0x80 | (i + at) % 128); };
  for (size_t i = 0; i < pages; i += 3) {  // written first, at the bytes the commit touches
    p[i * kPage] = mark(i, 0);
    p[i * kPage + 100] = mark(i, 100);
  }
  // The first piece starts inside a page (a tensor's start), the rest on page boundaries.
  std::vector<std::pair<unsigned char*, size_t>> pieces;
  pieces.emplace_back(p + 100, 8 * kPage - 100);
  for (size_t at = 8; at < pages; at += 5) pieces.emplace_back(p + at * kPage, std::min<size_t>(5, pages - at) * kPage);
  {
    CommitBeside commit;
    commit.Prepare(pieces, 3, keep);
    commit.Start();
    EXPECT_EQ(commit.threads(), 3u);
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
    while (!AllWritten(p, pages) && std::chrono::steady_clock::now() < deadline) usleep(1000);
    commit.Stop();
    commit.Join();
  }
  std::vector<bool> written = Written(p, pages);
  for (size_t i = 0; i < pages; ++i) EXPECT_TRUE(written[i]) << "page " << i << " not committed for writing";
  for (size_t i = 0; i < pages; ++i) {
    EXPECT_EQ(p[i * kPage], i % 3 == 0 ? mark(i, 0) : 0) << "page " << i;
    EXPECT_EQ(p[i * kPage + 100], i % 3 == 0 ? mark(i, 100) : 0) << "page " << i;
  }
}

// Without CAP_SYS_NICE and with an RLIMIT_NICE under 20 (a user's process, a default container), a
// thread at idle priority cannot be put back: the probe must say so, and so must the remembered answer in
// a child forked after the parent asked (the parent's may have been yes).
TEST(CommitBeside, TheProbeSaysNoWhereTheKernelKeepsAThreadIdle) {
  EXPECT_EQ(MayLeaveIdlePriority(), ProbeLeaveIdlePriority() == 1);  // remembered here, before the fork
  const int code = Unprivileged([] { return ProbeLeaveIdlePriority() != 0 ? 1 : MayLeaveIdlePriority() ? 3 : 0; });
  if (code == 2) GTEST_SKIP() << "the child could not drop CAP_SYS_NICE or RLIMIT_NICE here";
  EXPECT_NE(code, 1) << "the probe did not answer no where the kernel refuses";
  EXPECT_NE(code, 3) << "a forked child took its parent's remembered answer";
  EXPECT_EQ(code, 0);
}

// Where the threads could not be lifted and nothing keeps the pieces mapped past Join(), none starts.
TEST(CommitBeside, UnprivilegedWithNothingToKeepThePiecesStartsNoThread) {
  const int code = Unprivileged([] {
    std::vector<unsigned char> bytes(4 * kPage);
    CommitBeside commit;
    commit.Prepare({{bytes.data(), bytes.size()}}, 2);
    commit.Start();
    return commit.threads() == 0 ? 0 : 1;
  });
  if (code == 2) GTEST_SKIP() << "the child could not drop CAP_SYS_NICE or RLIMIT_NICE here";
  EXPECT_EQ(code, 0) << "threads started that Join() could neither lift nor keep the pieces for";
}

TEST(CommitBeside, StoppedBeforeItStartsStartsNoThread) {
  std::vector<unsigned char> bytes(4 * kPage);
  auto keep = std::make_shared<int>(0);
  CommitBeside commit;
  commit.Stop();
  commit.Prepare({{bytes.data(), bytes.size()}}, 2, keep);
  commit.Start();
  EXPECT_EQ(commit.threads(), 0u);
  commit.Join();
}

TEST(CommitBeside, NothingToCommitStartsNoThread) {
  CommitBeside commit;
  commit.Prepare({}, 4);
  commit.Start();
  EXPECT_EQ(commit.threads(), 0u);
  commit.Stop();
  commit.Join();
}

#ifdef UFFD_USER_MODE_ONLY
// Closes a userfaultfd on the way out: a fault it still holds is then served by the kernel, so a thread
// held there can be joined. Declared after the CommitBeside, it is destroyed first.
struct ClosesOnExit {
  int fd;
  ~ClosesOnExit() {
    if (fd >= 0) close(fd);
  }
};

// Registers [p, p + bytes) with `uffd` for its missing pages: their faults then wait for the test.
bool HoldMissingPages(int uffd, void* p, size_t bytes) {
  uffdio_api api{};
  api.api = UFFD_API;
  uffdio_register reg{};
  reg.range.start = reinterpret_cast<uintptr_t>(p);
  reg.range.len = bytes;
  reg.mode = UFFDIO_REGISTER_MODE_MISSING;
  return ioctl(uffd, UFFDIO_API, &api) == 0 && ioctl(uffd, UFFDIO_REGISTER, &reg) == 0;
}

// Gives the page at `p` (zeros) to a fault `uffd` holds there: the thread waiting in it goes on.
bool GivePage(int uffd, void* p) {
  std::vector<unsigned char> zeros(kPage, 0);
  uffdio_copy copy{};
  copy.dst = reinterpret_cast<uintptr_t>(p);
  copy.src = reinterpret_cast<uintptr_t>(zeros.data());
  copy.len = kPage;
  return ioctl(uffd, UFFDIO_COPY, &copy) == 0;
}

// A fault handler (userfaultfd) holds the commit's thread inside its first page: the fault is a write, the
// thread waits there at idle priority, Stop() lifts it back to the normal one, and once the page is given
// it ends without touching the next.
TEST(CommitBeside, RunsAtIdlePriorityFaultsForWritingAndStopsAtItsNextPage) {
  if (!MayLeaveIdlePriority()) GTEST_SKIP() << "this process may not lift a thread out of SCHED_IDLE: no commit";
  const size_t pages = 8;
  auto* p = static_cast<unsigned char*>(mmap(nullptr, pages * kPage, PROT_READ | PROT_WRITE,
                                             MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
  ASSERT_NE(p, MAP_FAILED);
  const int uffd = static_cast<int>(syscall(SYS_userfaultfd, O_CLOEXEC | O_NONBLOCK | UFFD_USER_MODE_ONLY));
  if (uffd < 0) {
    munmap(p, pages * kPage);
    GTEST_SKIP() << "no userfaultfd here (errno " << errno << "): the test holds a page fault with it";
  }
  {
    CommitBeside commit;
    ClosesOnExit closes{uffd};
    ASSERT_TRUE(HoldMissingPages(uffd, p, pages * kPage));
    commit.Prepare({{p, pages * kPage}}, 1);
    commit.Start();
    pollfd pfd{uffd, POLLIN, 0};
    ASSERT_EQ(poll(&pfd, 1, 30000), 1) << "the commit's thread never touched its first page";
    uffd_msg msg{};
    ASSERT_EQ(read(uffd, &msg, sizeof(msg)), static_cast<ssize_t>(sizeof(msg)));
    ASSERT_EQ(msg.event, UFFD_EVENT_PAGEFAULT);
    EXPECT_EQ(msg.arg.pagefault.address & ~(kPage - 1), reinterpret_cast<uintptr_t>(p));
    EXPECT_TRUE(msg.arg.pagefault.flags & UFFD_PAGEFAULT_FLAG_WRITE) << "a commit must fault for writing";

    std::vector<pid_t> fill = ThreadsNamed("shardcast-fill");
    ASSERT_EQ(fill.size(), 1u);
    EXPECT_EQ(sched_getscheduler(fill[0]), SCHED_IDLE);
    commit.Stop();
    EXPECT_EQ(sched_getscheduler(fill[0]), SCHED_OTHER) << "Stop() left a starved thread at idle priority";
    EXPECT_EQ(commit.let_go(), 0u) << "a thread Stop() lifted would be let go";

    ASSERT_TRUE(GivePage(uffd, p));
    EXPECT_EQ(poll(&pfd, 1, 500), 0) << "the thread touched another page after Stop()";
  }
  std::vector<bool> written = Written(p, pages);
  EXPECT_TRUE(written[0]);
  for (size_t i = 1; i < pages; ++i) EXPECT_FALSE(written[i]) << "page " << i << " touched after Stop()";
  munmap(p, pages * kPage);
}

// The same, where this process may not lift the thread (a user's process, a default container): Join()
// returns at once with the thread still held in its fault at idle priority, the thread keeps the pieces
// alive (`keep`) until it ends, and once the page is given it ends without touching the next. A code a
// check; 0 when all held.
int LetGoWhileHeld() {
  if (MayLeaveIdlePriority()) return 10;
  const size_t pages = 8;
  auto* p = static_cast<unsigned char*>(mmap(nullptr, pages * kPage, PROT_READ | PROT_WRITE,
                                             MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
  if (p == MAP_FAILED) return 11;
  const int uffd = static_cast<int>(syscall(SYS_userfaultfd, O_CLOEXEC | O_NONBLOCK | UFFD_USER_MODE_ONLY));
  if (uffd < 0) return 4;
  ClosesOnExit closes{uffd};  // on an early return: the thread held in its fault then ends
  if (!HoldMissingPages(uffd, p, pages * kPage)) return 12;
  std::weak_ptr<const void> kept;
  pollfd pfd{uffd, POLLIN, 0};
  {
    auto keep = std::make_shared<int>(0);
    kept = keep;
    CommitBeside commit;
    commit.Prepare({{p, pages * kPage}}, 1, std::move(keep));
    commit.Start();
    if (commit.threads() != 1) return 13;
    if (poll(&pfd, 1, 30000) != 1) return 14;
    uffd_msg msg{};
    if (read(uffd, &msg, sizeof(msg)) != static_cast<ssize_t>(sizeof(msg)) || msg.event != UFFD_EVENT_PAGEFAULT ||
        (msg.arg.pagefault.address & ~(kPage - 1)) != reinterpret_cast<uintptr_t>(p) ||
        !(msg.arg.pagefault.flags & UFFD_PAGEFAULT_FLAG_WRITE)) {
      return 15;
    }
    std::vector<pid_t> fill = ThreadsNamed("shardcast-fill");
    if (fill.size() != 1 || sched_getscheduler(fill[0]) != SCHED_IDLE) return 16;
    commit.Stop();
    if (commit.let_go() != 1) return 17;  // the report's commit_threads_let_go
    commit.Join();  // where it waits for the held thread, the parent's deadline ends the child: -2
    if (commit.threads() != 0 || ThreadsNamed("shardcast-fill").size() != 1) return 18;
    if (sched_getscheduler(fill[0]) != SCHED_IDLE) return 19;
  }
  if (kept.expired()) return 20;  // the thread let go no longer keeps the pieces it is inside
  if (!GivePage(uffd, p)) return 21;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  while (!kept.expired() && std::chrono::steady_clock::now() < deadline) usleep(1000);
  if (!kept.expired()) return 22;  // the thread never ended, or never let go of the pieces
  if (poll(&pfd, 1, 0) != 0) return 23;  // it touched another page after Stop() (it has ended: no wait)
  std::vector<bool> written = Written(p, pages);
  if (!written[0] || std::count(written.begin(), written.end(), true) != 1) return 24;
  munmap(p, pages * kPage);
  return 0;
}

TEST(CommitBeside, UnprivilegedLetsAHeldThreadGoWithWhatKeepsItsPiecesAndItEndsAtItsNextPage) {
  const int code = Unprivileged(LetGoWhileHeld);
  if (code == 2) GTEST_SKIP() << "the child could not drop CAP_SYS_NICE or RLIMIT_NICE here";
  if (code == 4) GTEST_SKIP() << "no userfaultfd here: the test holds a page fault with it";
  EXPECT_EQ(code, 0) << "check " << code << " of LetGoWhileHeld failed (-2: it hung, Join() waiting for the held "
                     << "thread; 10: the child took its parent's answer; 17: let_go() did not count it; 19: it "
                     << "was lifted; 20: nothing kept its pieces; 22: it never ended; 23, 24: it touched a page "
                     << "after Stop())";
}
#endif  // UFFD_USER_MODE_ONLY

}  // namespace
}  // namespace shardcast
