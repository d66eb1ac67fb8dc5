#include "runtime/comm/gloo_groups.h"

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include <algorithm>
#include <cstdio>
#include <map>
#include <mutex>
#include <random>

#include "allocators/error.h"
#include "runtime/agree/verdict.h"
#include "runtime/comm/store_channel.h"

namespace shardcast {

// c10d and gloo report timeouts in their messages; everything else is a comm failure.
bool LooksLikeTimeout(const std::string& what) {
  for (const char* s : {"imed out", "imeout", "timeout"}) {
    if (what.find(s) != std::string::npos) return true;
  }
  return false;
}

std::vector<int> RanksOfTimedOutKeys(const std::string& what, int world_size) {
  const size_t at = what.find("keys: ");
  if (at == std::string::npos) return {};
  std::vector<int> ranks;
  size_t begin = at + 6;
  while (begin < what.size()) {
    size_t end = what.find_first_of(", )\n", begin);
    if (end == std::string::npos) end = what.size();
    const std::string key = what.substr(begin, end - begin);
    const size_t slash = key.find_last_of('/');
    const std::string last = slash == std::string::npos ? key : key.substr(slash + 1);
    if (last.empty() || last.size() > 9 || last.find_first_not_of("0123456789") != std::string::npos) return {};
    const int rank = std::stoi(last);
    if (rank >= world_size) return {};
    if (std::find(ranks.begin(), ranks.end(), rank) == ranks.end()) ranks.push_back(rank);
    begin = what.find_first_not_of(", ", end);
    if (begin == std::string::npos || what[begin] == ')' || what[begin] == '\n') break;
  }
  std::sort(ranks.begin(), ranks.end());
  return ranks;
}

namespace {

std::mutex kept_mu;

// By the store the operations' prefixes share (the caller's group's own). Never destroyed: at exit the
// OS closes the sockets, where joining gloo's threads from a static destructor could hang.
std::map<const c10d::Store*, KeptGroup>& Kept() {
  static auto* kept = new std::map<const c10d::Store*, KeptGroup>();
  return *kept;
}

std::string FreshToken() {
  std::random_device random;
  const uint64_t v = (static_cast<uint64_t>(random()) << 32) ^ random();
  char text[17];
  std::snprintf(text, sizeof text, "%016llx", static_cast<unsigned long long>(v));
  return text;
}

// The ranks that appended themselves to "group/who".
std::vector<bool> Came(c10d::Store& store, int world_size) {
  const std::vector<uint8_t> v = store.check({"group/who"}) ? store.get("group/who") : std::vector<uint8_t>{};
  const std::vector<int> times = TimesOn(std::string(v.begin(), v.end()), world_size);
  std::vector<bool> came(times.size());
  for (size_t r = 0; r < times.size(); ++r) came[r] = times[r] > 0;
  return came;
}

std::string Absent(c10d::Store& store, int world_size) {
  const std::vector<bool> came = Came(store, world_size);
  std::vector<int> missing;
  for (int r = 0; r < world_size; ++r) {
    if (!came[r]) missing.push_back(r);
  }
  return RanksText(missing);
}

// Of `absent` (ranks this one already waited for), those that have not come to this vote, as text ("rank
// 2", "ranks 2, 5"); "" when one of them has come (it was late, not gone: the vote waits as usual), when
// there are none, or when the store cannot say who came.
std::string StillAbsent(c10d::Store& store, const std::vector<int>& absent, int world_size) {
  if (absent.empty()) return "";
  std::vector<bool> came;
  try {
    came = Came(store, world_size);
  } catch (const c10::Error&) {
    return "";
  }
  for (int r : absent) {
    if (r < 0 || r >= world_size || came[r]) return "";
  }
  return RanksText(absent);
}

}  // namespace

const c10d::Store* GroupOf(const c10::intrusive_ptr<c10d::Store>& store) {
  if (auto* prefixed = dynamic_cast<c10d::PrefixStore*>(store.get())) return prefixed->getUnderlyingStore().get();
  return store.get();
}

// This rank's kept group for `store`, taken out (an operation that fails does not put it back), where it
// was made for this rank, world size and timeout (gloo's own deadline is the one it was made with).
std::optional<KeptGroup> TakeKept(const c10::intrusive_ptr<c10d::Store>& store, int rank, int world_size,
                                  std::chrono::milliseconds timeout) {
  std::lock_guard<std::mutex> lock(kept_mu);
  auto it = Kept().find(GroupOf(store));
  if (it == Kept().end()) return std::nullopt;
  KeptGroup kept = std::move(it->second);
  Kept().erase(it);
  if (kept.rank != rank || kept.world_size != world_size || kept.timeout != timeout) return std::nullopt;
  return kept;
}

std::string AgreeOnGroup(c10d::Store& store, const std::string& mine, int rank, int world_size,
                         std::chrono::milliseconds timeout, const std::vector<int>& absent) {
  auto bytes = [](const std::string& s) { return std::vector<uint8_t>(s.begin(), s.end()); };
  auto first = [&](const std::string& value) {  // the decision's one value: this one, or the one before it
    const std::vector<uint8_t> now = store.compareSet("group/decision", {}, bytes(value));
    return std::string(now.begin(), now.end());
  };
  try {  // who came, for the error when someone does not; a store that cannot append only says less
    store.append("group/who", bytes(std::to_string(rank) + " "));
  } catch (const c10::Error&) {
  }
  bool differs = mine.empty();
  if (!differs) {
    const std::vector<uint8_t> now = store.compareSet("group/token", {}, bytes(mine));
    differs = std::string(now.begin(), now.end()) != mine;
  }
  if (differs) store.add("group/differ", 1);
  std::string decided;
  if (store.add("group/arrived", 1) == world_size) {
    decided = first(store.add("group/differ", 0) == 0 ? "reuse " + mine : "new " + FreshToken());
  } else if (const std::string gone = StillAbsent(store, absent, world_size); !gone.empty()) {
    // Already waited for in this operation, and still not here: the outcome is known, the wait is not
    // repeated. Every rank acts on the one decision, one that comes later too.
    decided = first("absent " + gone + " did not, nor to an earlier exchange of this operation");
  } else {
    try {
      store.wait({"group/decision"}, timeout);
      const std::vector<uint8_t> v = store.get("group/decision");
      decided = std::string(v.begin(), v.end());
    } catch (const c10::Error& e) {  // the store answered: not every rank came (a frozen host never answers)
      if (!LooksLikeTimeout(e.what_without_backtrace())) throw;
      const std::string absent = Absent(store, world_size);
      decided = first("absent " + (absent.empty() ? "every rank came, one too late" : absent + " did not"));
    }
  }
  if (decided.rfind("absent ", 0) == 0) {
    throw Error(ErrorKind::kCommTimeout, "",
                "not every rank came within " + std::to_string(timeout.count()) + " ms (" + decided.substr(7) +
                    "): a rank died, is frozen, or does not call the same shardcast operation");
  }
  return decided;
}

void PutKept(const c10d::Store* group, KeptGroup kept) {
  std::lock_guard<std::mutex> lock(kept_mu);
  // A program that makes and destroys many groups would keep one Gloo group (W - 1 sockets, two
  // threads) for each; past a few, one goes (the ranks agree on reuse, so which one does not matter).
  constexpr size_t kMostKept = 8;
  if (Kept().size() >= kMostKept && Kept().count(group) == 0) Kept().erase(Kept().begin());
  Kept()[group] = std::move(kept);
}

void ForgetKept() {
  std::map<const c10d::Store*, KeptGroup> gone;  // torn down outside the lock
  {
    std::lock_guard<std::mutex> lock(kept_mu);
    gone.swap(Kept());
  }
}

}  // namespace shardcast
