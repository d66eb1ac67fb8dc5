#include "runtime/agree/failure.h"

#include "allocators/error.h"

namespace shardcast {
namespace {

FailureNote NoteOf(const std::exception& e) {
  if (auto* se = dynamic_cast<const Error*>(&e)) return FailureNote{se->kind(), se->what()};
  return FailureNote{ErrorKind::kInternal, e.what()};
}

}  // namespace

bool IsCommFailure(const std::exception& e) {
  auto* se = dynamic_cast<const Error*>(&e);
  return se != nullptr && (se->kind() == ErrorKind::kComm || se->kind() == ErrorKind::kCommTimeout);
}

Problem AsProblem(const std::exception& e) {
  if (auto* se = dynamic_cast<const Error*>(&e)) return Problem{se->kind(), se->what()};
  return Problem{ErrorKind::kInternal, e.what()};
}

void FailTogether(Communicator& comm, const std::exception& e, const char* phase) {
  FailureNote mine = NoteOf(e);
  const bool comm_failure = IsCommFailure(e);
  if (!comm_failure) mine.message = "rank " + std::to_string(comm.rank()) + ": " + mine.message;
  std::optional<FailureNote> agreed;
  if (comm.rank() != 0 && comm_failure) agreed = comm.FetchFailure(kFailureFetchWait);
  if (!agreed) agreed = comm.PublishFailure(mine);
  const FailureNote final = agreed.value_or(mine);
  comm.Abort();  // peers blocked on us fail now, and fetch the message
  if (comm.rank() == 0) comm.AwaitFailureAcks(comm.world_size() - 1, kFailureAckWait);
  throw Error(final.kind, phase, final.message);
}

}  // namespace shardcast
