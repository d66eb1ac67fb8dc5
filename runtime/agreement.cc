#include "runtime/agreement.h"

#include "allocators/error.h"
#include "runtime/failure.h"

namespace shardcast {
namespace {

constexpr int kCoordinator = 0;  // decides for everyone

template <typename F>
void Try(Problem* local, F&& step) {
  if (!local->message.empty()) return;
  try {
    step();
  } catch (const std::exception& e) {
    *local = AsProblem(e);
  }
}

}  // namespace

void DecideAndAgree(Communicator& comm, const Deciding& d, Problem local) {
  Facts facts;
  if (!d.facts.empty()) facts = AllGather(comm, d.facts);
  const bool coordinator = comm.rank() == kCoordinator;
  std::string decision;
  if (coordinator) {
    Try(&local, [&] { decision = d.decide(facts); });
    if (local.message.empty() && decision.empty()) local = {ErrorKind::kInternal, "an empty decision"};
    if (!local.message.empty()) decision.clear();
  }
  int64_t size = static_cast<int64_t>(decision.size());
  comm.Broadcast(&size, sizeof(size), kCoordinator);
  if (!coordinator) decision.resize(static_cast<size_t>(size));
  comm.Broadcast(decision.data(), decision.size(), kCoordinator);
  // An empty decision means the coordinator failed: its problem is in the verdict, checking is moot.
  if (size > 0) Try(&local, [&] { d.check(decision, facts); });
  Agree(comm, d.phase, local);
}

}  // namespace shardcast
