#include "runtime/comm/store_channel.h"

#include <netdb.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <future>
#include <map>
#include <memory>
#include <mutex>
#include <sstream>
#include <thread>

namespace shardcast {
namespace {

constexpr const char* kFailureKey = "shardcast/failure";
constexpr const char* kAcksKey = "shardcast/failure_acks";

std::vector<uint8_t> Bytes(const std::string& s) { return std::vector<uint8_t>(s.begin(), s.end()); }

}  // namespace

std::string EncodeFailure(const FailureNote& note) {
  return std::to_string(static_cast<int>(note.kind)) + "|" + note.message;
}

FailureNote DecodeFailure(const std::string& value) {
  const size_t bar = value.find('|');
  if (bar == std::string::npos || bar == 0 || bar > 2) return {ErrorKind::kComm, value};
  int kind = 0;
  for (size_t i = 0; i < bar; ++i) {
    if (value[i] < '0' || value[i] > '9') return {ErrorKind::kComm, value};
    kind = kind * 10 + (value[i] - '0');
  }
  if (kind > static_cast<int>(ErrorKind::kInternal)) return {ErrorKind::kComm, value};
  return {static_cast<ErrorKind>(kind), value.substr(bar + 1)};
}

DeadlineWorker::DeadlineWorker() : q_(std::make_shared<Queue>()) {
  std::thread([q = q_] {
    std::unique_lock<std::mutex> l(q->mu);
    for (;;) {
      q->cv.wait(l, [&] { return q->stop || !q->tasks.empty(); });
      if (q->tasks.empty()) return;  // stopped, nothing left
      std::function<void()> task = std::move(q->tasks.front());
      q->tasks.pop_front();
      l.unlock();
      task();  // a packaged_task: its exception goes to its future
      l.lock();
    }
  }).detach();
}

DeadlineWorker::~DeadlineWorker() {
  {
    std::lock_guard<std::mutex> l(q_->mu);
    q_->stop = true;
    q_->tasks.clear();  // never run: nobody waits for them any more
  }
  q_->cv.notify_all();
}

void DeadlineWorker::Post(std::function<void()> task) {
  Submit([task = std::move(task)] {
    try {
      task();
    } catch (...) {  // a store that failed: the channel's next awaited call finds it
    }
  });
}

void DeadlineWorker::Submit(std::function<void()> task) {
  {
    std::lock_guard<std::mutex> l(q_->mu);
    q_->tasks.push_back(std::move(task));
  }
  q_->cv.notify_one();
}

StoreChannel::StoreChannel(c10::intrusive_ptr<c10d::Store> store, std::string host, StoreAddress at,
                           std::chrono::milliseconds op_deadline)
    : store_(std::move(store)), host_(std::move(host)), at_(Resolved(at)), deadline_(op_deadline) {}

FailureNote StoreSilent(const std::string& host) {
  return FailureNote{ErrorKind::kCommTimeout, host + " did not answer: it is frozen or unreachable"};
}

FailureNote StoreLost(const std::string& host) {
  return FailureNote{ErrorKind::kComm, host + " is lost: its connection closed or its port refuses connections"};
}

namespace {

// One address: ECONNREFUSED, 0 (accepted) or another errno (ETIMEDOUT when nothing came within `wait`).
int ConnectOutcome(const addrinfo& a, std::chrono::milliseconds wait) {
  const int fd = socket(a.ai_family, a.ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, a.ai_protocol);
  if (fd < 0) return errno;
  int err = connect(fd, a.ai_addr, a.ai_addrlen) == 0 ? 0 : errno;
  if (err == EINPROGRESS) {
    const auto until = std::chrono::steady_clock::now() + wait;
    int n = -1;
    for (;;) {  // a signal on this thread (a handler the program set) is no answer: poll again, for what is left
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(until - std::chrono::steady_clock::now());
      pollfd p{fd, POLLOUT, 0};
      n = poll(&p, 1, static_cast<int>(std::max<int64_t>(left.count(), 0)));
      if (n >= 0 || errno != EINTR) break;
    }
    socklen_t len = sizeof(err);
    if (n != 1 || getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len) != 0) err = ETIMEDOUT;
  }
  close(fd);
  return err;
}

// An address this machine cannot use at all (an IPv6 ::1 where IPv6 is off, a family not built in): it says
// nothing of the store's host, so it neither refuses nor answers.
bool Unusable(int err) {
  return err == EADDRNOTAVAIL || err == EAFNOSUPPORT || err == ENETUNREACH || err == EPROTONOSUPPORT ||
         err == EPFNOSUPPORT;
}

bool Known(const StoreAddress& at) { return !at.addr.empty() && at.port > 0 && at.port <= 65535; }

// host's stream addresses on `port`, numeric: asking no name service (host is an address's text); nullptr
// where none. Freed by the caller (freeaddrinfo).
addrinfo* Lookup(const std::string& host, int port, bool numeric) {
  addrinfo hints{};
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICSERV | (numeric ? AI_NUMERICHOST : 0);
  addrinfo* found = nullptr;
  return getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &found) == 0 ? found : nullptr;
}

// The names this process resolved (Resolved), with their numeric addresses.
std::mutex& KeptMutex() {
  static std::mutex mu;
  return mu;
}
std::map<std::pair<std::string, int>, std::vector<std::string>>& Kept() {
  static std::map<std::pair<std::string, int>, std::vector<std::string>> kept;
  return kept;
}
std::vector<std::string> KeptAddresses(const StoreAddress& at) {
  std::lock_guard<std::mutex> l(KeptMutex());
  const auto it = Kept().find({at.addr, at.port});
  return it == Kept().end() ? std::vector<std::string>{} : it->second;
}

}  // namespace

StoreAddress Resolved(const StoreAddress& at, std::chrono::milliseconds wait) noexcept {
  try {
    StoreAddress r = at;
    if (!Known(at) || !at.numeric.empty()) return r;
    if (addrinfo* literal = Lookup(at.addr, at.port, /*numeric=*/true)) {  // an address already: no lookup
      freeaddrinfo(literal);
      r.numeric = {at.addr};
      return r;
    }
    // Once a process, for every channel after it too (an operation makes several; a channel made after the
    // store's host died asks nothing then). Only names that resolved are kept.
    r.numeric = KeptAddresses(at);
    if (!r.numeric.empty()) return r;
    std::function<std::vector<std::string>()> resolve = [at] {
      std::vector<std::string> numeric;
      addrinfo* found = Lookup(at.addr, at.port, /*numeric=*/false);
      for (addrinfo* a = found; a != nullptr; a = a->ai_next) {
        char text[NI_MAXHOST];
        if (getnameinfo(a->ai_addr, a->ai_addrlen, text, sizeof(text), nullptr, 0, NI_NUMERICHOST) == 0 &&
            std::find(numeric.begin(), numeric.end(), text) == numeric.end()) {
          numeric.emplace_back(text);
        }
      }
      if (found != nullptr) freeaddrinfo(found);
      return numeric;
    };
    r.numeric = WithDeadline(std::move(resolve), wait * 3).value_or(std::vector<std::string>{});
    if (!r.numeric.empty()) {
      std::lock_guard<std::mutex> l(KeptMutex());
      Kept().emplace(std::make_pair(at.addr, at.port), r.numeric);
    }
    return r;
  } catch (...) {  // no thread or no memory: not known, so never taken as refused
    return StoreAddress{};
  }
}

bool StoreRefuses(const StoreAddress& at, std::chrono::milliseconds wait) noexcept {
  if (!Known(at)) return false;
  try {
    StoreAddress to = at;  // a name this process resolved before (a rendezvous that failed late): its addresses
    if (to.numeric.empty()) to.numeric = KeptAddresses(at);
    std::function<bool()> probe = [at = std::move(to), wait] {
      bool refused = false, answered = false;  // refused: one address refused, and none accepted or was silent
      const bool numeric = !at.numeric.empty();
      for (const std::string& host : numeric ? at.numeric : std::vector<std::string>{at.addr}) {
        addrinfo* found = Lookup(host, at.port, numeric);
        for (addrinfo* a = found; a != nullptr && !answered; a = a->ai_next) {
          const int err = ConnectOutcome(*a, wait);
          if (err == ECONNREFUSED) {
            refused = true;
          } else if (!Unusable(err)) {
            answered = true;
          }
        }
        if (found != nullptr) freeaddrinfo(found);
        if (answered) break;
      }
      return refused && !answered;
    };
    return WithDeadline(std::move(probe), wait * 3).value_or(false);  // a name not resolved in time: unknown
  } catch (...) {  // no thread for the probe (std::system_error): unknown, never a false "lost"
    return false;
  }
}

FailureNote StoreUnanswered(const std::string& host, const StoreAddress& at) {
  return StoreRefuses(at) ? StoreLost(host) : StoreSilent(host);
}

template <typename T>
std::optional<T> StoreChannel::Call(std::function<T(c10d::Store&)> op) {
  if (!store_ || loss_) return std::nullopt;
  try {
    if (!worker_) worker_ = std::make_unique<DeadlineWorker>();
    std::optional<T> r = worker_->Run<T>([store = store_, op = std::move(op)] { return op(*store); }, deadline_);
    if (!r) loss_ = StoreUnanswered(host_, at_);
    return r;
  } catch (...) {
    loss_ = StoreLost(host_);  // the cause differs from rank to rank (reset, closed, refused): not quoted
  }
  return std::nullopt;
}

std::optional<FailureNote> StoreChannel::Publish(const FailureNote& mine) {
  if (!store_) return std::nullopt;
  const std::vector<uint8_t> desired = Bytes(EncodeFailure(mine));
  auto standing = Call<std::vector<uint8_t>>(
      [desired](c10d::Store& s) { return s.compareSet(kFailureKey, {}, desired); });
  if (!standing) return loss_;
  return DecodeFailure(std::string(standing->begin(), standing->end()));
}

std::optional<FailureNote> StoreChannel::Fetch(std::chrono::milliseconds wait) {
  if (!store_) return std::nullopt;
  const auto until = std::chrono::steady_clock::now() + wait;
  // Polled with check, which a live store answers at once: no server-side wait to cancel.
  for (;;) {
    auto there = Call<bool>([](c10d::Store& s) { return s.check({kFailureKey}); });
    if (!there) return loss_;
    if (*there) break;
    if (std::chrono::steady_clock::now() >= until) return std::nullopt;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  auto value = Call<std::vector<uint8_t>>([](c10d::Store& s) {
    std::vector<uint8_t> v = s.get(kFailureKey);
    s.add(kAcksKey, 1);
    return v;
  });
  if (!value) return loss_;
  return DecodeFailure(std::string(value->begin(), value->end()));
}

bool StoreChannel::Published() {
  if (!store_) return false;
  return Call<bool>([](c10d::Store& s) { return s.check({kFailureKey}); }).value_or(false);
}

void StoreChannel::AwaitAcks(int n, std::chrono::milliseconds wait) {
  const auto until = std::chrono::steady_clock::now() + wait;
  while (std::chrono::steady_clock::now() < until) {
    auto acks = Call<int64_t>([](c10d::Store& s) { return s.add(kAcksKey, 0); });
    if (!acks || *acks >= n) return;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
}

std::vector<int> TimesOn(const std::string& list, int world_size) {
  std::vector<int> times(static_cast<size_t>(std::max(world_size, 0)), 0);
  std::istringstream in(list);
  for (std::string word; in >> word;) {
    if (word.empty() || word.size() > 9 || !std::all_of(word.begin(), word.end(), ::isdigit)) continue;
    const int r = std::stoi(word);
    if (r < world_size) ++times[static_cast<size_t>(r)];
  }
  return times;
}

void StoreChannel::Reach(const std::string& step, int rank) {
  const std::vector<uint8_t> me = Bytes(std::to_string(rank) + " ");
  Call<bool>([key = "shardcast/reached/" + step, me](c10d::Store& s) {
    s.append(key, me);
    return true;
  });
}

void StoreChannel::ReachLater(const std::string& step, int rank) {
  if (!store_ || loss_) return;
  try {
    if (!worker_) worker_ = std::make_unique<DeadlineWorker>();
    worker_->Post([store = store_, key = "shardcast/reached/" + step, me = Bytes(std::to_string(rank) + " ")] {
      store->append(key, me);
    });
  } catch (...) {  // no thread or no memory for it: the list lacks this rank, which only words an error
  }
}

std::optional<std::vector<int>> StoreChannel::NotReached(const std::string& step, int world_size, int times) {
  auto list = Call<std::string>([key = "shardcast/reached/" + step](c10d::Store& s) {
    const std::vector<uint8_t> v = s.check({key}) ? s.get(key) : std::vector<uint8_t>{};
    return std::string(v.begin(), v.end());
  });
  if (!list) return std::nullopt;
  const std::vector<int> came = TimesOn(*list, world_size);
  std::vector<int> missing;
  for (int r = 0; r < world_size; ++r) {
    if (came[static_cast<size_t>(r)] < times) missing.push_back(r);
  }
  return missing;
}

}  // namespace shardcast
