// bench_gloo_group: what one operation's Gloo group costs to make and use, full mesh against lazy init,
// at W ranks over one TCPStore server.
//
//   parent: TCPStore server ── spawns ceil(W / 64) children (64 ranks a process: a full mesh of 256
//           ranks is 255 sockets a rank, and one process may hold 20,000 fds here)
//   child:  one thread a rank, each with its own TCPStore client, then on "go":
//             MakeGlooGroup (the library's) and the group's barrier              -> ready
//             the handshake's collectives: AllGather of 8 int64s (an all-reduce), the decision's
//             size and 4 KiB from rank 0 (two broadcasts), the verdict (Agree: one bit a rank, then
//             slots only where one is set), the stream's closing barrier         -> end
//           and, between barriers, each timed alone: the verdict as it was before 2026-11-27 (one all-reduce
//           of W slots of 1 KiB, "W slots") and Agree as it is ("verdict"); slowest rank, median of runs
//           each checked: rank r's facts in row r, rank 0's decision bytes, no verdict
//
// Times are from "go" to the last rank's ready / end (one clock: steady_clock is system-wide here).
// fds: opened by the groups, per rank (the child's /proc/self/fd after the collectives, less before the
// groups were made). Store requests: every call the group makes on its operation store, counted.
//
//   bench_gloo_group [--worlds 8,32,64,128,256] [--runs 3] [--timeout-s 120] [--json OUT]
#include <spawn.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "runtime/agree/verdict.h"
#include "runtime/comm/c10d_communicator.h"
#include "runtime/comm/gloo_group.h"

extern char** environ;

namespace shardcast::bench {
namespace {

using Clock = std::chrono::steady_clock;
constexpr int kRanksPerProcess = 64;

int64_t NowNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now().time_since_epoch()).count();
}

std::vector<uint8_t> Bytes(const std::string& s) { return {s.begin(), s.end()}; }

// The operation store, counting every request the group makes on it.
class CountingStore : public c10d::PrefixStore {
 public:
  CountingStore(std::string prefix, c10::intrusive_ptr<c10d::Store> store)
      : PrefixStore(std::move(prefix), std::move(store)) {}
  std::atomic<int64_t> requests{0};

  void set(const std::string& k, const std::vector<uint8_t>& v) override { ++requests; PrefixStore::set(k, v); }
  std::vector<uint8_t> compareSet(const std::string& k, const std::vector<uint8_t>& e,
                                  const std::vector<uint8_t>& d) override {
    ++requests;
    return PrefixStore::compareSet(k, e, d);
  }
  std::vector<uint8_t> get(const std::string& k) override { ++requests; return PrefixStore::get(k); }
  int64_t add(const std::string& k, int64_t v) override { ++requests; return PrefixStore::add(k, v); }
  bool check(const std::vector<std::string>& k) override { ++requests; return PrefixStore::check(k); }
  void wait(const std::vector<std::string>& k) override { ++requests; PrefixStore::wait(k); }
  void wait(const std::vector<std::string>& k, const std::chrono::milliseconds& t) override {
    ++requests;
    PrefixStore::wait(k, t);
  }
  std::vector<std::vector<uint8_t>> multiGet(const std::vector<std::string>& k) override {
    ++requests;
    return PrefixStore::multiGet(k);
  }
  void multiSet(const std::vector<std::string>& k, const std::vector<std::vector<uint8_t>>& v) override {
    ++requests;
    PrefixStore::multiSet(k, v);
  }
};

int OpenFds() {
  int n = 0;
  for (const auto& e : std::filesystem::directory_iterator("/proc/self/fd")) (void)e, ++n;
  return n;
}

struct RankResult {
  int64_t ready_ns = 0, end_ns = 0, requests = 0, w_slots_ns = 0, verdict_ns = 0;
  bool ok = false;
  std::string error;
};

// One rank: its store client, the wait for "go", the group, the handshake's collectives.
void RunRank(const std::string& run, int port, int rank, int world, bool lazy, std::chrono::milliseconds timeout,
             std::atomic<int>* arrived_here, const std::atomic<bool>* counted, std::atomic<int>* ended_here,
             RankResult* out) {
  c10d::TCPStoreOptions so;
  so.port = static_cast<uint16_t>(port);
  so.isServer = false;
  so.waitWorkers = false;
  so.timeout = timeout;
  auto client = c10::make_intrusive<c10d::TCPStore>("127.0.0.1", so);
  auto ctl = c10::make_intrusive<c10d::PrefixStore>(run + "/ctl", client);
  auto store = c10::make_intrusive<CountingStore>(run + "/op", client);
  ++*arrived_here;
  while (!counted->load()) std::this_thread::sleep_for(std::chrono::milliseconds(2));  // fds before the groups
  if (ctl->add("arrived", 1) == world) ctl->set("all-arrived", Bytes("1"));
  ctl->wait({"go"});
  try {
    const GlooConnect connect = lazy ? GlooConnect::kLazy : GlooConnect::kFullMesh;
    auto comm = WrapC10dBackend(MakeGlooGroup(store, rank, world, timeout, "127.0.0.1", connect), timeout, store);
    comm->Barrier();  // what readies a group on every rank (C10dCommunicator::Ready)
    out->ready_ns = NowNs();
    std::vector<int64_t> facts = {rank, world, 1, 2, 3, 4, 5, rank * 7};
    auto all = AllGather(*comm, facts);
    bool ok = static_cast<int>(all.size()) == world;
    for (int r = 0; ok && r < world; ++r) ok = all[r][0] == r && all[r][7] == r * 7;
    int64_t size = 4096;
    comm->Broadcast(&size, sizeof(size), 0);
    std::vector<unsigned char> decision(static_cast<size_t>(size));
    if (rank == 0) {
      for (size_t i = 0; i < decision.size(); ++i) decision[i] = static_cast<unsigned char>(i * 131 + 7);
    }
    comm->Broadcast(decision.data(), decision.size(), 0);
    for (size_t i = 0; ok && i < decision.size(); ++i) ok = decision[i] == static_cast<unsigned char>(i * 131 + 7);
    comm->Barrier();
    int64_t t = NowNs();
    std::vector<int64_t> slots(static_cast<size_t>(world) * (kVerdictSlotBytes / 8), 0);  // the verdict before
    comm->AllReduceSum(slots.data(), slots.size());
    out->w_slots_ns = NowNs() - t;
    comm->Barrier();
    t = NowNs();
    Agree(*comm, "bench", Problem{});
    out->verdict_ns = NowNs() - t;
    comm->Barrier();
    out->end_ns = NowNs();
    out->requests = store->requests.load();
    out->ok = ok;
    if (!ok) out->error = "wrong bytes";
    ++*ended_here;
    // Teardown only once every rank ended: a group torn down early would fail a peer still in the barrier.
    if (ctl->add("ended", 1) == world) ctl->set("all-ended", Bytes("1"));
    ctl->wait({"all-ended"});
    while (ended_here->load() >= 0) std::this_thread::sleep_for(std::chrono::milliseconds(5));  // fds counted
  } catch (const std::exception& e) {
    out->ok = false;
    if (out->error.empty()) out->error = std::string(e.what()).substr(0, 300);
    if (out->end_ns == 0) ++*ended_here;
  }
}

int Child(const std::string& run, int port, int world, int first, int count, bool lazy, int timeout_s,
          const std::string& out_path) {
  std::atomic<int> arrived{0}, ended{0};
  std::atomic<bool> counted{false};
  std::vector<RankResult> results(count);
  std::vector<std::thread> threads;
  for (int i = 0; i < count; ++i) {
    threads.emplace_back(RunRank, run, port, first + i, world, lazy, std::chrono::milliseconds(timeout_s * 1000),
                         &arrived, &counted, &ended, &results[i]);
  }
  while (arrived.load() < count) std::this_thread::sleep_for(std::chrono::milliseconds(2));
  const int fds_before = OpenFds();  // every rank's store client connected, no group made yet
  counted.store(true);
  while (ended.load() < count) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  const int fds_after = OpenFds();
  ended.store(-1);
  const auto t0 = Clock::now();
  for (auto& t : threads) t.join();  // each rank's group torn down with its thread
  const double teardown_s = std::chrono::duration<double>(Clock::now() - t0).count();
  nlohmann::json j;
  j["fds_before"] = fds_before;
  j["fds_after"] = fds_after;
  j["teardown_s"] = teardown_s;
  for (const auto& r : results) {
    j["ranks"].push_back({{"ready_ns", r.ready_ns}, {"end_ns", r.end_ns}, {"requests", r.requests}, {"ok", r.ok},
                          {"error", r.error}, {"w_slots_ns", r.w_slots_ns}, {"verdict_ns", r.verdict_ns}});
  }
  std::ofstream(out_path) << j.dump();
  return 0;
}

struct RunFigures {
  double ready_s = 0, end_s = 0, teardown_s = 0, fds_per_rank = 0, w_slots_s = 0, verdict_s = 0;
  int64_t requests = 0;
  bool ok = false;
  std::string error;
};

RunFigures Parent(const std::string& self, const c10::intrusive_ptr<c10d::TCPStore>& server, int run_id, int world,
                  bool lazy, int timeout_s) {
  const std::string run = "run" + std::to_string(run_id);
  const int procs = (world + kRanksPerProcess - 1) / kRanksPerProcess;
  std::vector<pid_t> pids;
  std::vector<std::string> outs;
  for (int p = 0; p < procs; ++p) {
    const int first = p * kRanksPerProcess, count = std::min(kRanksPerProcess, world - first);
    outs.push_back("/tmp/bench_gloo_group." + std::to_string(getpid()) + "." + run + "." + std::to_string(p) + ".json");
    std::vector<std::string> args = {self, "--child", run, std::to_string(server->getPort()), std::to_string(world),
                                     std::to_string(first), std::to_string(count), lazy ? "lazy" : "full",
                                     std::to_string(timeout_s), outs.back()};
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    pid_t pid;
    if (posix_spawn(&pid, self.c_str(), nullptr, nullptr, argv.data(), environ) != 0) throw std::runtime_error("spawn");
    pids.push_back(pid);
  }
  auto ctl = c10::make_intrusive<c10d::PrefixStore>(run + "/ctl", server);
  ctl->wait({"all-arrived"}, std::chrono::milliseconds(timeout_s * 1000));
  const int64_t go_ns = NowNs();
  ctl->set("go", Bytes("1"));
  RunFigures f;
  const auto deadline = Clock::now() + std::chrono::seconds(2 * timeout_s);
  for (pid_t pid : pids) {
    int status = 0;
    while (waitpid(pid, &status, WNOHANG) == 0) {
      if (Clock::now() > deadline) {
        kill(pid, SIGKILL);
        waitpid(pid, &status, 0);
        f.error = "a child ran past " + std::to_string(2 * timeout_s) + " s";
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  }
  int64_t ready = 0, end = 0, fds = 0, ranks = 0;
  f.ok = f.error.empty();
  for (const auto& path : outs) {
    std::ifstream in(path);
    if (!in) {
      f.ok = false;
      if (f.error.empty()) f.error = "no result from " + path;
      continue;
    }
    auto j = nlohmann::json::parse(in);
    std::filesystem::remove(path);
    fds += j["fds_after"].get<int64_t>() - j["fds_before"].get<int64_t>();
    f.teardown_s = std::max(f.teardown_s, j["teardown_s"].get<double>());
    for (const auto& r : j["ranks"]) {
      ++ranks;
      ready = std::max(ready, r["ready_ns"].get<int64_t>());
      end = std::max(end, r["end_ns"].get<int64_t>());
      f.w_slots_s = std::max(f.w_slots_s, r["w_slots_ns"].get<int64_t>() / 1e9);
      f.verdict_s = std::max(f.verdict_s, r["verdict_ns"].get<int64_t>() / 1e9);
      f.requests += r["requests"].get<int64_t>();
      if (!r["ok"].get<bool>()) {
        f.ok = false;
        if (f.error.empty()) f.error = r["error"].get<std::string>();
      }
    }
  }
  f.ready_s = (ready - go_ns) / 1e9;
  f.end_s = (end - go_ns) / 1e9;
  f.fds_per_rank = ranks ? static_cast<double>(fds) / ranks : 0;
  return f;
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

int Main(int argc, char** argv) {
  if (argc >= 2 && std::string(argv[1]) == "--child") {
    return Child(argv[2], std::stoi(argv[3]), std::stoi(argv[4]), std::stoi(argv[5]), std::stoi(argv[6]),
                 std::string(argv[7]) == "lazy", std::stoi(argv[8]), argv[9]);
  }
  std::vector<int> worlds = {8, 32, 64, 128, 256};
  int runs = 3, timeout_s = 120;
  std::string json_path;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string a = argv[i], v = argv[i + 1];
    if (a == "--worlds") {
      worlds.clear();
      std::stringstream ss(v);
      for (std::string w; std::getline(ss, w, ',');) worlds.push_back(std::stoi(w));
    } else if (a == "--runs") {
      runs = std::stoi(v);
    } else if (a == "--timeout-s") {
      timeout_s = std::stoi(v);
    } else if (a == "--json") {
      json_path = v;
    } else {
      std::cerr << "unknown argument " << a << "\n";
      return 2;
    }
  }
  rlimit lim{};
  getrlimit(RLIMIT_NOFILE, &lim);
  lim.rlim_cur = lim.rlim_max;  // the children inherit it
  setrlimit(RLIMIT_NOFILE, &lim);
  const std::string self = std::filesystem::read_symlink("/proc/self/exe");
  c10d::TCPStoreOptions so;
  so.port = 0;
  so.isServer = true;
  so.waitWorkers = false;
  so.timeout = std::chrono::milliseconds(timeout_s * 1000);
  auto server = c10::make_intrusive<c10d::TCPStore>("127.0.0.1", so);
  std::map<std::pair<int, bool>, std::vector<RunFigures>> all;
  int run_id = 0;
  for (int r = 0; r < runs; ++r) {
    for (int w : worlds) {
      for (int m = 0; m < 2; ++m) {
        const bool lazy = (m + r) % 2 == 1;  // interleaved: the first mode alternates between runs
        RunFigures f = Parent(self, server, run_id++, w, lazy, timeout_s);
        std::printf("run %d W=%d %-9s ready %.3f s end %.3f s (W slots %.3f s, verdict %.3f s) teardown %.3f s "
                    "fds/rank %.1f requests %lld %s %s\n",
                    r, w, lazy ? "lazy" : "full mesh", f.ready_s, f.end_s, f.w_slots_s, f.verdict_s, f.teardown_s,
                    f.fds_per_rank, static_cast<long long>(f.requests), f.ok ? "ok" : "FAILED", f.error.c_str());
        std::fflush(stdout);
        all[{w, lazy}].push_back(f);
      }
    }
  }
  nlohmann::json j;
  std::printf("\n| W | mode | ready (s) | end of handshake (s) | W slots (s) | verdict (s) | teardown (s) | "
              "fds a rank | store requests | ok |\n");
  for (const auto& [key, fs] : all) {
    std::vector<double> ready, end, tear, fds, w_slots, verdict;
    bool ok = true;
    for (const auto& f : fs) {
      ready.push_back(f.ready_s), end.push_back(f.end_s), tear.push_back(f.teardown_s), fds.push_back(f.fds_per_rank);
      w_slots.push_back(f.w_slots_s), verdict.push_back(f.verdict_s);
      ok = ok && f.ok;
    }
    std::printf("| %d | %s | %.3f | %.3f | %.3f | %.4f | %.3f | %.1f | %lld | %s |\n", key.first,
                key.second ? "lazy" : "full mesh", Median(ready), Median(end), Median(w_slots), Median(verdict),
                Median(tear), Median(fds), static_cast<long long>(fs.front().requests), ok ? "yes" : "NO");
    nlohmann::json e = {{"world", key.first}, {"mode", key.second ? "lazy" : "full_mesh"}, {"ok", ok},
                        {"ready_s", ready}, {"end_s", end}, {"teardown_s", tear}, {"fds_per_rank", fds},
                        {"store_requests", fs.front().requests}, {"w_slots_s", w_slots}, {"verdict_s", verdict}};
    j["results"].push_back(e);
  }
  if (!json_path.empty()) std::ofstream(json_path) << j.dump(1) << "\n";
  return 0;
}

}  // namespace
}  // namespace shardcast::bench

int main(int argc, char** argv) { return shardcast::bench::Main(argc, argv); }
