#include "allocators/error.h"

#include <cstring>

namespace shardcast {

const char* ErrorKindName(ErrorKind kind) {
  switch (kind) {
    case ErrorKind::kInvalidArgument: return "InvalidArgument";
    case ErrorKind::kConfig: return "ConfigError";
    case ErrorKind::kCheckpoint: return "CheckpointError";
    case ErrorKind::kIo: return "IoError";
    case ErrorKind::kManifestMismatch: return "ManifestMismatch";
    case ErrorKind::kCommTimeout: return "CommTimeout";
    case ErrorKind::kComm: return "CommError";
    case ErrorKind::kUnsupported: return "Unsupported";
    case ErrorKind::kInternal: return "InternalError";
  }
  return "Error";
}

ErrorKind ErrorKindFromName(const std::string& name) {
  for (int k = 0; k <= static_cast<int>(ErrorKind::kInternal); ++k) {
    if (name == ErrorKindName(static_cast<ErrorKind>(k))) return static_cast<ErrorKind>(k);
  }
  return ErrorKind::kInternal;
}

std::string ErrnoText(int err) {
  char buf[256];
  // GNU strerror_r may return a static string instead of filling buf.
  const char* s = strerror_r(err, buf, sizeof(buf));
  return std::string(s) + " (errno " + std::to_string(err) + ")";
}

}  // namespace shardcast
