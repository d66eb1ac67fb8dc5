#include "allocators/commit_beside.h"

#include <dirent.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <linux/capability.h>
#include <linux/userfaultfd.h>
#include <poll.h>
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

// Every page of every piece is committed by a write, and the bytes written before the commit are kept
// where it touches them (each piece's first byte, then one a page further on): a touch that stored a zero
// would wipe what a reader had written there.
TEST(CommitBeside, CommitsEveryPageOfItsPiecesForWritingAndKeepsTheirBytes) {
  if (!MayLeaveIdlePriority()) GTEST_SKIP() << "this process may not lift a thread out of SCHED_IDLE: no commit";
  const size_t pages = 64;
  auto* p = static_cast<unsigned char*>(LazyZeroAllocate(pages * kPage));
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
    commit.Prepare(pieces, 3);
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
  LazyZeroFree(p, pages * kPage);
}

// Without CAP_SYS_NICE and with an RLIMIT_NICE under 20 (a user's process, a default container), a
// thread at idle priority cannot be put back: the probe must say so, so that no commit starts there.
TEST(CommitBeside, TheProbeSaysNoWhereTheKernelKeepsAThreadIdle) {
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    rlimit none{0, 0};
    if (setrlimit(RLIMIT_NICE, &none) != 0) _exit(2);
    __user_cap_header_struct header{_LINUX_CAPABILITY_VERSION_3, 0};
    __user_cap_data_struct caps[2]{};
    if (syscall(SYS_capget, &header, caps) != 0) _exit(2);
    caps[0].effective &= ~(1u << CAP_SYS_NICE);
    if (syscall(SYS_capset, &header, caps) != 0) _exit(2);
    _exit(ProbeLeaveIdlePriority() == 0 ? 0 : 1);
  }
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status));
  if (WEXITSTATUS(status) == 2) GTEST_SKIP() << "the child could not drop CAP_SYS_NICE or RLIMIT_NICE here";
  EXPECT_EQ(WEXITSTATUS(status), 0) << "the probe did not answer no where the kernel refuses";
  EXPECT_EQ(MayLeaveIdlePriority(), ProbeLeaveIdlePriority() == 1);
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
  uffdio_api api{};
  api.api = UFFD_API;
  uffdio_register reg{};
  reg.range.start = reinterpret_cast<uintptr_t>(p);
  reg.range.len = pages * kPage;
  reg.mode = UFFDIO_REGISTER_MODE_MISSING;
  {
    CommitBeside commit;
    ClosesOnExit closes{uffd};
    ASSERT_EQ(ioctl(uffd, UFFDIO_API, &api), 0);
    ASSERT_EQ(ioctl(uffd, UFFDIO_REGISTER, &reg), 0);
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

    std::vector<unsigned char> zeros(kPage, 0);
    uffdio_copy copy{};
    copy.dst = reinterpret_cast<uintptr_t>(p);
    copy.src = reinterpret_cast<uintptr_t>(zeros.data());
    copy.len = kPage;
    ASSERT_EQ(ioctl(uffd, UFFDIO_COPY, &copy), 0);
    EXPECT_EQ(poll(&pfd, 1, 500), 0) << "the thread touched another page after Stop()";
  }
  std::vector<bool> written = Written(p, pages);
  EXPECT_TRUE(written[0]);
  for (size_t i = 1; i < pages; ++i) EXPECT_FALSE(written[i]) << "page " << i << " touched after Stop()";
  munmap(p, pages * kPage);
}
#endif  // UFFD_USER_MODE_ONLY

}  // namespace
}  // namespace shardcast
