#include "runtime/agree/agreement.h"

#include "allocators/error.h"
#include "runtime/agree/failure.h"

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

// Steps 1-5; `local` gains the problem decide or check throws.
void Steps(Communicator& comm, const Deciding& d, Problem& local) {
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

}  // namespace

void DecideAndAgree(Communicator& comm, const Deciding& d, Problem local) {
  try {
    Steps(comm, d, local);
  } catch (const Error& e) {
    // A collective failed (a peer died or froze). Where this rank had failed before, that is the cause
    // the user needs (e.g. "rank 0's keys did not arrive"), not only the timeout that followed it.
    const bool comm_failure = e.kind() == ErrorKind::kComm || e.kind() == ErrorKind::kCommTimeout;
    if (!comm_failure || local.message.empty()) throw;
    throw Error(e.kind(), e.what(),
                std::string("this rank's own failure, which the ") + d.phase + " was to share: " + local.message);
  }
}

}  // namespace shardcast
