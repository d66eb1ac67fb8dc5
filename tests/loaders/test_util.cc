#include "tests/loaders/test_util.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <stdexcept>

namespace shardcast::testing {

TempDir::TempDir() {
  const char* base = std::getenv("TMPDIR");
  std::string tmpl = std::string(base && *base ? base : "/tmp") + "/shardcast-test-XXXXXX";
  if (mkdtemp(tmpl.data()) == nullptr) throw std::runtime_error("mkdtemp failed");
  path_ = tmpl;
}

TempDir::~TempDir() {
  std::string cmd = "rm -rf '" + path_ + "'";
  if (std::system(cmd.c_str()) != 0) {
    // nothing useful to do in a destructor
  }
}

std::string Image(const std::string& header_json, const std::string& data) {
  std::string out(8, '\0');
  uint64_t n = header_json.size();
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((n >> (8 * i)) & 0xff);
  return out + header_json + data;
}

void WriteFile(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  if (!out) throw std::runtime_error("cannot write " + path);
}

std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::string SharedDir() {
  std::string dir = SHARDCAST_SHARED_DIR;
  struct stat st;
  if (stat((dir + "/data/safetensors-samples").c_str(), &st) == 0) return dir;
  return {};
}

}  // namespace shardcast::testing

namespace shardcast::testing {
namespace {

void WriteAllTo(int fd, const std::string& s) {
  size_t done = 0;
  while (done < s.size()) {
    ssize_t n = ::write(fd, s.data() + done, s.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return;
    done += static_cast<size_t>(n);
  }
}

}  // namespace

std::string ChildOutcome::Describe() const {
  static const char* names[] = {"returned", "threw shardcast::Error", "threw another exception", "crashed",
                                "timed out"};
  std::string s = std::string(names[state]) + " after " + std::to_string(elapsed.count()) + " ms";
  if (state == kThrewError) s += " (" + std::string(ErrorKindName(kind)) + ")";
  return message.empty() ? s : s + ": " + message;
}

ChildOutcome RunInChild(const std::function<std::string()>& body, std::chrono::milliseconds deadline) {
  const auto start = std::chrono::steady_clock::now();
  int fds[2];
  if (pipe2(fds, O_CLOEXEC) != 0) throw std::runtime_error("pipe2 failed");
  std::fflush(nullptr);
  pid_t pid = fork();
  if (pid < 0) throw std::runtime_error("fork failed");
  if (pid == 0) {
    ::close(fds[0]);
    // One state byte, then the ErrorKind as one byte, then the message.
    std::string out;
    try {
      out = std::string(1, static_cast<char>(ChildOutcome::kReturned)) + '\0' + body();
    } catch (const Error& e) {
      out = std::string(1, static_cast<char>(ChildOutcome::kThrewError)) + static_cast<char>(e.kind()) + e.what();
    } catch (const std::exception& e) {
      out = std::string(1, static_cast<char>(ChildOutcome::kThrewOther)) + '\0' + e.what();
    } catch (...) {
      out = std::string(1, static_cast<char>(ChildOutcome::kThrewOther)) + '\0' + "unknown exception";
    }
    WriteAllTo(fds[1], out);
    _exit(0);  // no atexit handlers, no leak check of the parent's state
  }
  ::close(fds[1]);
  std::string got;
  bool eof = false, timed_out = false;
  while (!eof) {
    auto left = deadline - std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - start);
    if (left.count() <= 0) {
      timed_out = true;
      break;
    }
    pollfd p{fds[0], POLLIN, 0};
    int r = poll(&p, 1, static_cast<int>(left.count()));
    if (r < 0 && errno == EINTR) continue;
    if (r == 0) continue;  // the deadline check above ends the loop
    char buf[4096];
    ssize_t n = ::read(fds[0], buf, sizeof(buf));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) eof = true;
    else got.append(buf, static_cast<size_t>(n));
  }
  ::close(fds[0]);
  if (timed_out) kill(pid, SIGKILL);
  int status = 0;
  while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  ChildOutcome o;
  o.elapsed = std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - start);
  if (timed_out) {
    o.state = ChildOutcome::kTimedOut;
  } else if (got.size() >= 2 && WIFEXITED(status) && WEXITSTATUS(status) == 0) {
    o.state = static_cast<ChildOutcome::State>(got[0]);
    o.kind = static_cast<ErrorKind>(got[1]);
    o.message = got.substr(2);
  } else {
    o.state = ChildOutcome::kCrashed;
    o.message = WIFSIGNALED(status) ? "killed by signal " + std::to_string(WTERMSIG(status))
                                    : "exit status " + std::to_string(WEXITSTATUS(status));
  }
  return o;
}

std::vector<Mapping> Smaps() {
  std::vector<Mapping> out;
  std::ifstream smaps("/proc/self/smaps");
  for (std::string line; std::getline(smaps, line);) {
    uintptr_t begin = 0, end = 0;
    char dash = 0;
    std::istringstream head(line);
    if (head >> std::hex >> begin >> dash >> end && dash == '-') {
      out.push_back({begin, end, {}});
    } else if (!out.empty() && line.rfind("VmFlags:", 0) == 0) {
      out.back().vm_flags = line;
    }
  }
  return out;
}

}  // namespace shardcast::testing
