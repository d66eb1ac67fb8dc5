#include "tools/subprocess.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <climits>
#include <cstring>
#include <thread>

#include "allocators/error.h"

extern char** environ;

namespace shardcast {
namespace {

using Clock = std::chrono::steady_clock;

std::vector<std::string> MergedEnv(const std::vector<std::string>& add) {
  std::vector<std::string> out;
  for (char** e = environ; *e != nullptr; ++e) {
    std::string kv = *e;
    std::string name = kv.substr(0, kv.find('='));
    bool replaced = false;
    for (const auto& a : add) replaced |= a.compare(0, name.size() + 1, name + "=") == 0;
    if (!replaced) out.push_back(kv);
  }
  out.insert(out.end(), add.begin(), add.end());
  return out;
}

}  // namespace

std::string SelfExe() {
  char buf[PATH_MAX];
  ssize_t n = readlink("/proc/self/exe", buf, sizeof(buf) - 1);
  if (n <= 0) throw Error(ErrorKind::kIo, "/proc/self/exe", "cannot resolve: " + ErrnoText(errno));
  buf[n] = '\0';
  return buf;
}

int FreeLocalPort() {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = 0;
  socklen_t len = sizeof(a);
  if (fd < 0 || bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0 ||
      getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) != 0) {
    if (fd >= 0) close(fd);
    throw Error(ErrorKind::kIo, "local port", "cannot find a free local port: " + ErrnoText(errno));
  }
  int port = ntohs(a.sin_port);
  close(fd);
  return port;
}

LocalListener LocalListener::Open() {
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(a);
  if (fd < 0 || bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0 || listen(fd, 1024) != 0 ||
      getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) != 0) {
    const int err = errno;
    if (fd >= 0) close(fd);
    throw Error(ErrorKind::kIo, "local listener", "cannot listen on 127.0.0.1: " + ErrnoText(err));
  }
  return LocalListener(fd, ntohs(a.sin_port));
}

LocalListener::~LocalListener() { Close(); }

void LocalListener::Close() {
  if (fd_ >= 0) close(fd_);
  fd_ = -1;
}

Subprocess Subprocess::Spawn(const SpawnOptions& options) {
  if (options.argv.empty()) throw Error(ErrorKind::kInvalidArgument, "spawn", "empty argv");
  // Everything the child needs is built before fork: after it, only async-signal-safe calls.
  std::vector<std::string> env = MergedEnv(options.env);
  std::vector<char*> argv, envp;
  for (const auto& a : options.argv) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  for (const auto& e : env) envp.push_back(const_cast<char*>(e.c_str()));
  envp.push_back(nullptr);
  int in_pipe[2] = {-1, -1}, out_pipe[2] = {-1, -1};
  if ((options.pipe_stdin && pipe2(in_pipe, O_CLOEXEC) != 0) || (options.pipe_stdout && pipe2(out_pipe, O_CLOEXEC) != 0)) {
    throw Error(ErrorKind::kIo, options.argv[0], "pipe: " + ErrnoText(errno));
  }
  const pid_t parent = getpid();
  pid_t pid = fork();
  if (pid < 0) throw Error(ErrorKind::kIo, options.argv[0], "fork: " + ErrnoText(errno));
  if (pid == 0) {
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (getppid() != parent) _exit(127);  // the parent died before prctl took effect
    if (options.pipe_stdin) dup2(in_pipe[0], STDIN_FILENO);
    if (options.pipe_stdout) dup2(out_pipe[1], STDOUT_FILENO);
    for (int fd : options.inherit_fds) fcntl(fd, F_SETFD, 0);  // this child only keeps it across exec
    execve(argv[0], argv.data(), envp.data());
    _exit(127);
  }
  Subprocess p;
  p.pid_ = pid;
  if (options.pipe_stdin) {
    close(in_pipe[0]);
    p.in_ = in_pipe[1];
  }
  if (options.pipe_stdout) {
    close(out_pipe[1]);
    p.out_ = out_pipe[0];
  }
  return p;
}

Subprocess::Subprocess(Subprocess&& o) noexcept { *this = std::move(o); }

Subprocess& Subprocess::operator=(Subprocess&& o) noexcept {
  std::swap(pid_, o.pid_);
  std::swap(in_, o.in_);
  std::swap(out_, o.out_);
  std::swap(buffer_, o.buffer_);
  std::swap(exit_code_, o.exit_code_);
  return *this;
}

Subprocess::~Subprocess() {
  if (in_ >= 0) close(in_);
  if (out_ >= 0) close(out_);
  if (pid_ > 0 && !exit_code_) {
    kill(pid_, SIGKILL);
    int status;
    waitpid(pid_, &status, 0);
  }
}

void Subprocess::Reap(int status) {
  exit_code_ = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

bool Subprocess::running() {
  if (exit_code_) return false;
  int status;
  pid_t r = waitpid(pid_, &status, WNOHANG);
  if (r == pid_) Reap(status);
  return !exit_code_;
}

void Subprocess::CloseStdin() {
  if (in_ >= 0) close(in_);
  in_ = -1;
}

void Subprocess::Kill(int sig) {
  if (pid_ > 0 && !exit_code_) kill(pid_, sig);
}

std::optional<std::string> Subprocess::ReadLine(std::chrono::milliseconds timeout) {
  const auto deadline = Clock::now() + timeout;
  while (true) {
    auto nl = buffer_.find('\n');
    if (nl != std::string::npos) {
      std::string line = buffer_.substr(0, nl);
      buffer_.erase(0, nl + 1);
      return line;
    }
    if (out_ < 0) return std::nullopt;
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
    if (left <= 0) {
      throw Error(ErrorKind::kCommTimeout, "pid " + std::to_string(pid_),
                  "no output line within " + std::to_string(timeout.count()) + " ms");
    }
    pollfd pfd{out_, POLLIN, 0};
    int r = poll(&pfd, 1, static_cast<int>(std::min<long long>(left, INT_MAX)));
    if (r < 0 && errno != EINTR) throw Error(ErrorKind::kIo, "pid " + std::to_string(pid_), "poll: " + ErrnoText(errno));
    if (r <= 0) continue;
    char buf[65536];
    ssize_t n = read(out_, buf, sizeof(buf));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      close(out_);
      out_ = -1;
      if (buffer_.empty()) return std::nullopt;
      std::string rest;
      rest.swap(buffer_);
      return rest;
    }
    buffer_.append(buf, static_cast<size_t>(n));
  }
}

int Subprocess::Wait(std::chrono::milliseconds timeout) {
  const auto deadline = Clock::now() + timeout;
  while (running()) {
    if (Clock::now() >= deadline) {
      Kill(SIGKILL);
      int status;
      waitpid(pid_, &status, 0);
      Reap(status);
      throw Error(ErrorKind::kCommTimeout, "pid " + std::to_string(pid_),
                  "did not exit within " + std::to_string(timeout.count()) + " ms; killed");
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return *exit_code_;
}

}  // namespace shardcast
