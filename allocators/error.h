// shardcast/error: the one exception type every component throws across its boundary.
//
// An Error carries a Kind (what a caller may branch on; the Python binding maps each Kind to one
// exception class) and a two-part message: context (file, key, rank, byte range) then cause.
// It lives in allocators/ because that is the lowest layer; nothing here knows about tensors or ranks.
#pragma once

#include <stdexcept>
#include <string>

namespace shardcast {

enum class ErrorKind {
  kInvalidArgument,   // bad option, flag or call: the caller's mistake
  kConfig,            // an HF config.json that cannot become a ModelSpec
  kCheckpoint,        // a checkpoint file or index that is malformed, missing or truncated
  kIo,                // the OS refused: open, mmap, write, rename
  kManifestMismatch,  // ranks disagree with the checkpoint or with each other
  kCommTimeout,       // a collective did not finish within its timeout
  kComm,              // a collective failed (peer died, connection lost)
  kUnsupported,       // valid, but not something this build or version handles
  kInternal,          // a broken invariant: a bug in shardcast
};

const char* ErrorKindName(ErrorKind kind);            // "CheckpointError", as the Python classes are named
ErrorKind ErrorKindFromName(const std::string& name);  // the inverse; kInternal for an unknown name

class Error : public std::runtime_error {
 public:
  Error(ErrorKind kind, const std::string& context, const std::string& cause)
      : std::runtime_error(context.empty() ? cause : context + ": " + cause), kind_(kind) {}
  ErrorKind kind() const noexcept { return kind_; }

 private:
  ErrorKind kind_;
};

// errno as text, for kIo causes.
std::string ErrnoText(int err);

}  // namespace shardcast
