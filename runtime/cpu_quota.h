// runtime/cpu_quota: the CPUs this process's cgroup quota allows, read in one place. A Kubernetes pod's
// CPU limit is such a quota, while the pod's affinity masks still show every CPU of the host. Its readers:
// load.cc's thread count (ThreadsHere) and, through the binding (_shardcast.cpu_quota), from_pretrained's
// agreement on a node's CPUs (_stream_rules.py), which sums the quotas of the node's cgroups, each once.
//
// Where it looks, for a process whose /proc/self/cgroup says "0::/kubepods/pod1/ctr" (v2):
//
//   <root>/cgroup.controllers            present: a v2 hierarchy at <root> (else v1, or a hybrid: v1 at <root>)
//   <root>/kubepods/pod1/ctr/cpu.max     "400000 100000"  4 CPUs
//   <root>/kubepods/pod1/cpu.max         "150000 100000"  1.5 CPUs   <- the lowest: {inode of pod1, 1.5}
//   <root>/kubepods/cpu.max              "max 100000"     no quota
//   <root>/cpu.max                       absent           (the host's root; a cgroup namespace's own cgroup)
//
// v1 ("2:cpu,cpuacct:/slurm/job1"): the same walk under the cpu controller's mount, <root>/cpu,cpuacct or
// else <root>/cpu, of cpu.cfs_quota_us over cpu.cfs_period_us (quota -1: none).
//
// The files are hostile input: numbers are decimal integers as the kernel writes them (up to 18 digits),
// anything else is no quota; a file is read only when it is a regular file of at most 64 KiB; a cgroup path
// with ".." (a cgroup outside this namespace's view) or a NUL cannot be read, and neither can a process
// whose /proc line or mount is missing.
//
// Thread safety: pure functions of the files. Failure: none; what cannot be read is no quota (or
// {"", none}); only std::bad_alloc escapes.
#pragma once

#include <optional>
#include <string>

namespace shardcast {

inline constexpr const char* kCgroupRoot = "/sys/fs/cgroup";
inline constexpr const char* kProcCgroup = "/proc/self/cgroup";

struct CpuQuota {
  // The cgroup whose quota `cpus` is: its directory's inode number in decimal (unique within its hierarchy,
  // also across containers that each see their own cgroup as "/"), else its path where it cannot be
  // stat'ed; so ranks in sibling cgroups under one limited parent name the same cgroup. Where no cgroup has
  // a quota, the process's own cgroup. Empty where the process's cgroup cannot be found at all.
  std::string cgroup;
  // The CPUs the quota allows (quota over period: 1.5 for "150000 100000"); none where there is no quota
  // or it cannot be read.
  std::optional<double> cpus;
};

// The lowest CPU quota of the process's cgroup and of each parent up to the hierarchy's mount: cgroup v2's
// cpu.max under `root` where <root>/cgroup.controllers exists, else v1's quota and period under the cpu
// controller's mount, for the cgroup `proc` (a /proc/<pid>/cgroup file) names. Ties go to the deepest.
CpuQuota CpuQuotaOf(const std::string& root = kCgroupRoot, const std::string& proc = kProcCgroup);

// The whole CPUs `quota` allows, at least 1 (1.5 CPUs: 1; 0.5: 1), at most `none`; `none` where it has no
// quota.
int WholeCpus(const CpuQuota& quota, int none);

}  // namespace shardcast
