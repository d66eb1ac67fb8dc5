// The CPUs a cgroup quota allows (runtime/cpu_quota.h), on fake cgroup trees: a mount under a temp dir and
// a /proc/<pid>/cgroup file beside it, as _stream_rules.cpu_quota's Python tests build them.
#include "runtime/cpu_quota.h"

#include <gtest/gtest.h>
#include <sys/stat.h>

#include <climits>
#include <filesystem>
#include <map>
#include <string>

#include "tests/loaders/test_util.h"

namespace shardcast {
namespace {

namespace fs = std::filesystem;

// A cgroup tree: `proc` holds `lines`, `root` the files (paths relative to it, parents made).
struct Tree {
  Tree(const testing::TempDir& dir, const std::string& name, const std::string& lines,
       const std::map<std::string, std::string>& files)
      : root(dir / (name + "-fs")), proc(dir / (name + "-cgroup")) {
    fs::create_directories(root);
    testing::WriteFile(proc, lines);
    for (const auto& [rel, text] : files) {
      fs::create_directories(fs::path(root + "/" + rel).parent_path());
      testing::WriteFile(root + "/" + rel, text);
    }
  }
  CpuQuota Quota() const { return CpuQuotaOf(root, proc); }
  std::string Inode(const std::string& rel) const {
    struct stat st;
    EXPECT_EQ(::stat((root + "/" + rel).c_str(), &st), 0) << rel;
    return std::to_string(static_cast<unsigned long long>(st.st_ino));
  }
  std::string root, proc;
};

TEST(CpuQuotaOf, AV2QuotaIsTheLowestOfItsCgroupAndItsParentsNamedByTheLowestsInode) {
  testing::TempDir dir;
  Tree t(dir, "pod", "0::/kubepods/pod1/ctr\n",
         {{"cgroup.controllers", "cpu"}, {"kubepods/cpu.max", "max 100000\n"},
          {"kubepods/pod1/cpu.max", "150000 100000\n"}, {"kubepods/pod1/ctr/cpu.max", "400000 100000\n"}});
  const CpuQuota q = t.Quota();
  EXPECT_EQ(q.cpus, 1.5);
  EXPECT_EQ(q.cgroup, t.Inode("kubepods/pod1"));
  // A second container of the same pod with no limit of its own: the same cgroup's quota, counted once.
  fs::create_directories(t.root + "/kubepods/pod1/other");
  testing::WriteFile(t.proc, "0::/kubepods/pod1/other\n");
  const CpuQuota other = t.Quota();
  EXPECT_EQ(other.cgroup, q.cgroup);
  EXPECT_EQ(other.cpus, 1.5);
}

// Regression: load.cc's thread count read only <root>/cpu.max, which the host's root cgroup never has: a
// pod's quota on its own cgroup below the mount (no cgroup namespace), and any v1 quota, gave no bound.
TEST(CpuQuotaOf, AQuotaBelowTheMountIsFoundWhereTheMountItselfHasNone) {
  testing::TempDir dir;
  Tree t(dir, "below", "0::/kubepods.slice/pod.slice\n",
         {{"cgroup.controllers", "cpu memory"}, {"kubepods.slice/pod.slice/cpu.max", "200000 100000"}});
  EXPECT_EQ(t.Quota().cpus, 2.0);
  EXPECT_EQ(WholeCpus(t.Quota(), INT_MAX), 2);
}

TEST(CpuQuotaOf, InsideACgroupNamespaceTheMountIsTheProcessesOwnCgroup) {
  testing::TempDir dir;
  Tree t(dir, "ns", "0::/\n", {{"cgroup.controllers", "cpu"}, {"cpu.max", "250000 100000\n"}});
  EXPECT_EQ(t.Quota().cpus, 2.5);
  EXPECT_EQ(t.Quota().cgroup, t.Inode("."));
}

TEST(CpuQuotaOf, MaxIsNoQuotaAndNamesTheProcessesOwnCgroup) {
  testing::TempDir dir;
  Tree t(dir, "max", "0::/a/b\n", {{"cgroup.controllers", ""}, {"cpu.max", "max 100000\n"},
                                   {"a/cpu.max", "max 100000\n"}, {"a/b/cpu.max", "max 100000\n"}});
  const CpuQuota q = t.Quota();
  EXPECT_EQ(q.cpus, std::nullopt);
  EXPECT_EQ(q.cgroup, t.Inode("a/b"));
  EXPECT_EQ(WholeCpus(q, 7), 7);
}

TEST(CpuQuotaOf, ATieStaysWithTheDeeperCgroup) {
  testing::TempDir dir;
  Tree t(dir, "tie", "0::/a/b\n", {{"cgroup.controllers", ""}, {"a/cpu.max", "100000 100000"},
                                   {"a/b/cpu.max", "50000 50000"}});
  EXPECT_EQ(t.Quota().cgroup, t.Inode("a/b"));
  EXPECT_EQ(t.Quota().cpus, 1.0);
}

TEST(CpuQuotaOf, AV1QuotaIsItsQuotaOverItsPeriodUnderTheCpuControllersMount) {
  testing::TempDir dir;
  Tree t(dir, "v1", "4:memory:/x\n2:cpu,cpuacct:/slurm/job1\n0::/\n",
         {{"cpu,cpuacct/cpu.cfs_quota_us", "-1\n"}, {"cpu,cpuacct/cpu.cfs_period_us", "100000\n"},
          {"cpu,cpuacct/slurm/job1/cpu.cfs_quota_us", "300000\n"},
          {"cpu,cpuacct/slurm/job1/cpu.cfs_period_us", "100000\n"}});
  EXPECT_EQ(t.Quota().cpus, 3.0);
  EXPECT_EQ(t.Quota().cgroup, t.Inode("cpu,cpuacct/slurm/job1"));
  // Mounted as "cpu" (a symlink's name on many hosts) where there is no directory of the list's name.
  Tree cpu(dir, "v1cpu", "3:cpu,cpuacct:/job\n", {{"cpu/job/cpu.cfs_quota_us", "50000"},
                                                 {"cpu/job/cpu.cfs_period_us", "100000"}});
  EXPECT_EQ(cpu.Quota().cpus, 0.5);
  Tree unlimited(dir, "unlimited", "1:cpu:/\n", {{"cpu/cpu.cfs_quota_us", "-1"}, {"cpu/cpu.cfs_period_us", "100000"}});
  EXPECT_EQ(unlimited.Quota().cpus, std::nullopt);
  EXPECT_EQ(unlimited.Quota().cgroup, unlimited.Inode("cpu"));
  // A quota without its period is none.
  Tree half(dir, "half", "1:cpu:/\n", {{"cpu/cpu.cfs_quota_us", "100000"}});
  EXPECT_EQ(half.Quota().cpus, std::nullopt);
}

TEST(CpuQuotaOf, WhatCannotBeReadIsNoCgroupAndNoQuota) {
  testing::TempDir dir;
  const CpuQuota none{};
  auto same = [&none](const CpuQuota& q) { return q.cgroup == none.cgroup && q.cpus == none.cpus; };
  EXPECT_TRUE(same(CpuQuotaOf(dir / "absent", dir / "absent-proc")));
  EXPECT_TRUE(same(CpuQuotaOf(dir.path(), dir.path())));  // /proc's file is a directory
  // v2 without a "0::" line; v1 without a cpu line, or without its mount.
  EXPECT_TRUE(same(Tree(dir, "no0", "1:cpu:/x\n", {{"cgroup.controllers", ""}}).Quota()));
  EXPECT_TRUE(same(Tree(dir, "nocpu", "1:memory:/x\n2:cpuacct:/x\n", {{"cpuacct/cpu.cfs_quota_us", "1"}}).Quota()));
  EXPECT_TRUE(same(Tree(dir, "nomount", "1:cpu:/x\n", {{"memory/x", ""}}).Quota()));
  // Absent cgroup directories: no quota, named by the process's cgroup's path.
  const Tree gone(dir, "gone", "0::/not/here\n", {{"cgroup.controllers", ""}});
  EXPECT_EQ(gone.Quota().cpus, std::nullopt);
  EXPECT_EQ(gone.Quota().cgroup, gone.root + "/not/here");
}

TEST(CpuQuotaOf, FractionalQuotasAreTheirFractionAndWholeCpusTheirFloorAtLeastOne) {
  testing::TempDir dir;
  struct Case {
    const char* max;
    double cpus;
    int whole;
  };
  for (const Case& c : {Case{"150000 100000", 1.5, 1}, Case{"50000 100000", 0.5, 1}, Case{"1000 100000", 0.01, 1},
                        Case{"250000 100000", 2.5, 2}, Case{"700000 100000", 7.0, 7}}) {
    Tree t(dir, std::to_string(c.cpus), "0::/\n", {{"cgroup.controllers", ""}, {"cpu.max", c.max}});
    EXPECT_EQ(t.Quota().cpus, c.cpus) << c.max;
    EXPECT_EQ(WholeCpus(t.Quota(), INT_MAX), c.whole) << c.max;
  }
  EXPECT_EQ(WholeCpus(CpuQuota{"", 1e30}, INT_MAX), INT_MAX);
  EXPECT_EQ(WholeCpus(CpuQuota{"", 9.0}, 4), 4);
  EXPECT_EQ(WholeCpus(CpuQuota{"", std::nullopt}, 4), 4);
}

TEST(CpuQuotaOf, GarbageInTheQuotaFilesIsNoQuota) {
  testing::TempDir dir;
  int n = 0;
  for (const std::string& max :
       {std::string("lots"), std::string(""), std::string("150000"), std::string("150000 0"),
        std::string("-5 100000"), std::string("0 100000"), std::string("1.5e5 100000"), std::string("0x10 100000"),
        std::string("150000 -100000"), std::string("99999999999999999999 100000"),
        std::string("150000 99999999999999999999999999"), std::string("\xff\xfe\0 1", 5),
        std::string("150000 100000") + std::string(70 << 10, ' ')}) {
    Tree t(dir, "g" + std::to_string(n++), "0::/\n", {{"cgroup.controllers", ""}, {"cpu.max", max}});
    EXPECT_EQ(t.Quota().cpus, std::nullopt) << max.substr(0, 40);
    EXPECT_EQ(t.Quota().cgroup, t.Inode(".")) << max.substr(0, 40);
  }
  Tree v1(dir, "v1garbage", "1:cpu:/\n", {{"cpu/cpu.cfs_quota_us", "max"}, {"cpu/cpu.cfs_period_us", "x"}});
  EXPECT_EQ(v1.Quota().cpus, std::nullopt);
  // The largest numbers it reads: 18 digits each.
  Tree big(dir, "big", "0::/\n", {{"cgroup.controllers", ""}, {"cpu.max", "999999999999999999 1"}});
  EXPECT_EQ(big.Quota().cpus, 999999999999999999.0);
  EXPECT_EQ(WholeCpus(big.Quota(), INT_MAX), INT_MAX);
}

TEST(CpuQuotaOf, QuotaFilesThatAreNotRegularFilesAreNoQuota) {
  testing::TempDir dir;
  Tree t(dir, "odd", "0::/a/b\n", {{"cgroup.controllers", ""}, {"a/b/x", ""}});
  fs::create_directories(t.root + "/a/b/cpu.max");                     // a directory
  ASSERT_EQ(::mkfifo((t.root + "/a/cpu.max").c_str(), 0600), 0);      // a FIFO no one writes: never blocks
  fs::create_symlink("/dev/zero", t.root + "/cpu.max");                // endless zeros
  EXPECT_EQ(t.Quota().cpus, std::nullopt);
  EXPECT_EQ(t.Quota().cgroup, t.Inode("a/b"));
}

TEST(CpuQuotaOf, HostileProcLinesAreSkippedOrUnknownNeverACrash) {
  testing::TempDir dir;
  const std::map<std::string, std::string> files{{"cgroup.controllers", ""}, {"cpu.max", "100000 100000"},
                                                 {"a:b/cpu.max", "50000 100000"}};
  // Lines without two colons are skipped; the path is everything after the second colon.
  EXPECT_EQ(Tree(dir, "colons", "no colons\n0:\n0::/a:b\n", files).Quota().cpus, 0.5);
  EXPECT_EQ(Tree(dir, "slashes", "0:://a:b//./\n", files).Quota().cpus, 0.5);
  EXPECT_EQ(Tree(dir, "onlyjunk", "garbage\n\n\n::::::\n", files).Quota().cpus, std::nullopt);
  EXPECT_EQ(Tree(dir, "binary", std::string("\0\xff:\n\n", 5), files).Quota().cpus, std::nullopt);
  // ".." (a cgroup outside this namespace's view) and NUL cannot be read: no cgroup, no quota, however the
  // path would resolve.
  for (const std::string& path : {std::string("/.."), std::string("/../../etc"), std::string("/a:b/../a:b"),
                                  std::string("/a:b\0/x", 6)}) {
    const CpuQuota q = Tree(dir, "dots" + std::to_string(path.size()), "0::" + path + "\n", files).Quota();
    EXPECT_EQ(q.cgroup, "") << path;
    EXPECT_EQ(q.cpus, std::nullopt) << path;
  }
  // A v1 controller list that is a path is not a mount: only "cpu" is tried.
  Tree v1(dir, "v1path", "1:cpu,../..:/\n", {{"cpu/cpu.cfs_quota_us", "200000"}, {"cpu/cpu.cfs_period_us", "100000"}});
  EXPECT_EQ(v1.Quota().cpus, 2.0);
  // A /proc file far larger than any the kernel writes is not read.
  EXPECT_EQ(Tree(dir, "huge", std::string(1 << 20, '\n') + "0::/\n", files).Quota().cpus, std::nullopt);
}

TEST(CpuQuotaOf, ThisMachinesIsReadWithoutFailing) {
  const CpuQuota q = CpuQuotaOf();
  if (q.cpus) {
    EXPECT_GT(*q.cpus, 0.0);
  }
  EXPECT_GE(WholeCpus(q, INT_MAX), 1);
}

}  // namespace
}  // namespace shardcast
