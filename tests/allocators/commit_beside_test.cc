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

#include <fstream>
#include <string>
#include <vector>

#include "allocators/lazy_zero.h"

namespace shardcast {
namespace {

const size_t kPage = static_cast<size_t>(sysconf(_SC_PAGESIZE));

// Which of the `pages` pages from `p` are resident (mincore).
std::vector<bool> Resident(void* p, size_t pages) {
  std::vector<unsigned char> v(pages);
  EXPECT_EQ(mincore(p, pages * kPage, v.data()), 0);
  std::vector<bool> out(pages);
  for (size_t i = 0; i < pages; ++i) out[i] = v[i] & 1;
  return out;
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

// Every page of every piece is committed, and the bytes written before the commit are kept where it
// touches them (each piece's first byte, then one a page further on): a touch that stored a zero would
// wipe what a reader had written there.
TEST(CommitBeside, CommitsEveryPageOfItsPiecesAndKeepsTheirBytes) {
  const size_t pages = 64;
  auto* p = static_cast<unsigned char*>(LazyZeroAllocate(pages * kPage));
  const auto mark = [](size_t i, size_t at) { return static_cast<unsigned char>(0x80 | (i + at) % 128); };
  for (size_t i = 0; i < pages; i += 3) {  // written first, at the bytes the commit touches
    p[i * kPage] = mark(i, 0);
    p[i * kPage + 100] = mark(i, 100);
  }
  std::vector<std::pair<unsigned char*, size_t>> pieces;
  // The first piece starts inside a page (a tensor's start), the rest on page boundaries; the last page
  // is in none.
  pieces.emplace_back(p + 100, 8 * kPage - 100);
  for (size_t at = 8; at < pages - 1; at += 5) pieces.emplace_back(p + at * kPage, std::min<size_t>(5, pages - 1 - at) * kPage);
  {
    CommitBeside commit;
    commit.Prepare(pieces, 3);
    commit.Start();
    EXPECT_EQ(commit.threads(), MayLeaveIdlePriority() ? 3u : 0u);
    commit.Join();
  }
  std::vector<bool> resident = Resident(p, pages);
  if (MayLeaveIdlePriority()) {
    for (size_t i = 0; i + 1 < pages; ++i) EXPECT_TRUE(resident[i]) << "page " << i;
  }
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
    _exit(CanLeaveIdlePriority() ? 1 : 0);
  }
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_NE(WEXITSTATUS(status), 2) << "the child could not drop CAP_SYS_NICE or RLIMIT_NICE";
  EXPECT_EQ(WEXITSTATUS(status), 0) << "the probe said yes where the kernel refuses";
  EXPECT_EQ(MayLeaveIdlePriority(), CanLeaveIdlePriority());
}

TEST(CommitBeside, NothingToCommitStartsNoThread) {
  CommitBeside commit;
  commit.Prepare({}, 4);
  commit.Start();
  EXPECT_EQ(commit.threads(), 0u);
  commit.Stop();
  commit.Join();
}

// A fault handler (userfaultfd) holds the commit's thread inside its first page: while it waits there it
// runs at idle priority; Stop() puts it back at the normal one, and once the page is given it ends without
// touching the next.
TEST(CommitBeside, RunsAtIdlePriorityAndStopsAtItsNextPage) {
  const size_t pages = 8;
  auto* p = static_cast<unsigned char*>(mmap(nullptr, pages * kPage, PROT_READ | PROT_WRITE,
                                             MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
  ASSERT_NE(p, MAP_FAILED);
  const int uffd = static_cast<int>(syscall(SYS_userfaultfd, O_CLOEXEC | O_NONBLOCK | UFFD_USER_MODE_ONLY));
  if (uffd < 0) {
    munmap(p, pages * kPage);
    GTEST_SKIP() << "userfaultfd is not available here (errno " << errno << "): the test holds a page fault with it";
  }
  uffdio_api api{};
  api.api = UFFD_API;
  ASSERT_EQ(ioctl(uffd, UFFDIO_API, &api), 0);
  uffdio_register reg{};
  reg.range.start = reinterpret_cast<uintptr_t>(p);
  reg.range.len = pages * kPage;
  reg.mode = UFFDIO_REGISTER_MODE_MISSING;
  ASSERT_EQ(ioctl(uffd, UFFDIO_REGISTER, &reg), 0);
  if (!MayLeaveIdlePriority()) {
    close(uffd);
    munmap(p, pages * kPage);
    GTEST_SKIP() << "this process may not take a thread out of SCHED_IDLE: a commit starts no thread here";
  }

  CommitBeside commit;
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
  EXPECT_EQ(sched_getscheduler(fill[0]), SCHED_OTHER) << "Stop() leaves a starved thread at idle priority";

  std::vector<unsigned char> zeros(kPage, 0);
  uffdio_copy copy{};
  copy.dst = reinterpret_cast<uintptr_t>(p);
  copy.src = reinterpret_cast<uintptr_t>(zeros.data());
  copy.len = kPage;
  ASSERT_EQ(ioctl(uffd, UFFDIO_COPY, &copy), 0);
  commit.Join();
  std::vector<bool> resident = Resident(p, pages);
  EXPECT_TRUE(resident[0]);
  for (size_t i = 1; i < pages; ++i) EXPECT_FALSE(resident[i]) << "page " << i << " touched after Stop()";
  EXPECT_EQ(poll(&pfd, 1, 0), 0) << "a second fault after Stop()";
  close(uffd);
  munmap(p, pages * kPage);
}

}  // namespace
}  // namespace shardcast
