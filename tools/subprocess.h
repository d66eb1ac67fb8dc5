// tools/subprocess: child processes that cannot outlive their parent or hang it.
//
// Children get PR_SET_PDEATHSIG(SIGKILL), so a parent that dies takes them along. Every read and
// wait takes a timeout; a destructor kills and reaps a child still running. Used by the local
// multi-rank launcher and by benchmarks that measure each case in a process of its own.
//
// Thread safety: one Subprocess is used by one thread at a time.
// Failure: kIo when fork/exec/pipe fail; kCommTimeout when a read or wait runs past its timeout.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <optional>
#include <string>
#include <vector>

namespace shardcast {

struct SpawnOptions {
  std::vector<std::string> argv;             // argv[0] is the program path
  std::vector<std::string> env;              // "NAME=value" added to (or replacing in) the parent's environment
  bool pipe_stdin = false;                   // default false: inherit
  bool pipe_stdout = false;                  // default false: inherit
  std::vector<int> inherit_fds;              // default none: descriptors (else close-on-exec) the child keeps
};

class Subprocess {
 public:
  static Subprocess Spawn(const SpawnOptions& options);
  Subprocess(Subprocess&& o) noexcept;
  Subprocess& operator=(Subprocess&& o) noexcept;
  ~Subprocess();

  pid_t pid() const { return pid_; }
  bool running();
  void CloseStdin();
  // One line of stdout without its '\n'; nullopt at EOF. Throws kCommTimeout after `timeout`.
  std::optional<std::string> ReadLine(std::chrono::milliseconds timeout);
  // Waits for exit; returns the exit code, or 128 + signal. Kills it (SIGKILL) and throws
  // kCommTimeout after `timeout`.
  int Wait(std::chrono::milliseconds timeout);
  void Kill(int sig);

 private:
  Subprocess() = default;
  void Reap(int status);
  pid_t pid_ = -1;
  int in_ = -1, out_ = -1;
  std::string buffer_;
  std::optional<int> exit_code_;
};

// The path of the running executable (/proc/self/exe).
std::string SelfExe();

// A TCP port on 127.0.0.1 that was free a moment ago (for a local rendezvous). Racy: another process
// may take it before it is bound again; prefer ListenLocal.
int FreeLocalPort();

// A socket bound and listening on 127.0.0.1, on a port the kernel picked: hand `fd` to the rank that
// hosts the store (TCPStoreOptions::masterListenFd, as torchrun does), so no other process can take
// the port in between. Closes on destruction; close-on-exec unless inherited explicitly.
class LocalListener {
 public:
  static LocalListener Open();
  LocalListener(LocalListener&& o) noexcept : fd_(o.fd_), port_(o.port_) { o.fd_ = -1; }
  LocalListener(const LocalListener&) = delete;
  LocalListener& operator=(const LocalListener&) = delete;
  ~LocalListener();
  int fd() const { return fd_; }
  int port() const { return port_; }
  // Closes this process's copy once the rank that hosts the store holds its own (inherited): a copy kept here
  // would outlive that rank and queue the others' connects with no one to answer them, so a store host that
  // died would look frozen (and its port would not refuse the probe of StoreUnanswered). port() stays valid.
  void Close();

 private:
  LocalListener(int fd, int port) : fd_(fd), port_(port) {}
  int fd_ = -1;
  int port_ = 0;
};

}  // namespace shardcast
