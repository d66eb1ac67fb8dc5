// Test helpers for loaders tests: temp directories and hand-built safetensors images.
#pragma once

#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "allocators/error.h"

namespace shardcast::testing {

// A fresh directory under $TMPDIR, removed with everything in it on destruction.
class TempDir {
 public:
  TempDir();
  ~TempDir();
  const std::string& path() const { return path_; }
  std::string operator/(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

// 8-byte little-endian length + header + data: a safetensors image with exactly these bytes.
std::string Image(const std::string& header_json, const std::string& data);
void WriteFile(const std::string& path, const std::string& bytes);
std::string ReadFile(const std::string& path);

// The ../shared dir if present (CI has it), else empty.
std::string SharedDir();

// How a body run by RunInChild ended.
struct ChildOutcome {
  enum State {
    kReturned,        // body returned; `message` is what it returned
    kThrewError,      // body threw shardcast::Error; `kind` and `message` are its
    kThrewOther,      // body threw something else; `message` says what
    kCrashed,         // the child died (signal or sanitizer report); `message` says how
    kTimedOut,        // still running at the deadline: killed
  };
  State state = kCrashed;
  ErrorKind kind = ErrorKind::kInternal;
  std::string message;
  std::chrono::milliseconds elapsed{0};
  std::string Describe() const;  // one line for test failure messages
};

// Runs body in a forked child and waits at most `deadline` for it, so a body that blocks (open() on
// a FIFO) or runs away (a quadratic parse) fails its test instead of hanging it, and a crash is an
// outcome instead of the end of the test binary. The child shares nothing back but the outcome:
// gtest assertions inside body are lost, so body reports through its return value or by throwing.
ChildOutcome RunInChild(const std::function<std::string()>& body, std::chrono::milliseconds deadline);

// Sets or unsets environment variables for one test and restores them after (one that was unset or
// empty is unset again).
class Env {
 public:
  ~Env() {
    for (const auto& [name, old] : saved_) old.empty() ? ::unsetenv(name.c_str()) : ::setenv(name.c_str(), old.c_str(), 1);
  }
  void Set(const std::string& name, const std::string& value) {
    const char* old = ::getenv(name.c_str());
    saved_.emplace_back(name, old ? old : "");
    ::setenv(name.c_str(), value.c_str(), 1);
  }
  void Unset(const std::string& name) {
    const char* old = ::getenv(name.c_str());
    saved_.emplace_back(name, old ? old : "");
    ::unsetenv(name.c_str());
  }

 private:
  std::vector<std::pair<std::string, std::string>> saved_;
};

// One mapping of this process, as /proc/self/smaps lists it: [begin, end) and its "VmFlags:" line ("" where
// the kernel shows none, as a sandboxed one may).
struct Mapping {
  uintptr_t begin = 0, end = 0;
  std::string vm_flags;
  // Whether the kernel shows `flag` ("hg": MADV_HUGEPAGE) among them; it prints a space after every flag.
  bool Advised(const char* flag) const { return (vm_flags + " ").find(std::string(" ") + flag + " ") != std::string::npos; }
};
std::vector<Mapping> Smaps();

}  // namespace shardcast::testing

// Asserts `stmt` throws shardcast::Error of `kind` whose message contains every listed substring.
#define EXPECT_SC_ERROR(stmt, want_kind, ...)                                                       \
  do {                                                                                         \
    try {                                                                                      \
      stmt;                                                                                    \
      ADD_FAILURE() << "expected shardcast::Error from " #stmt;                                \
    } catch (const ::shardcast::Error& e) {                                                    \
      EXPECT_EQ(e.kind(), want_kind) << e.what();                                                 \
      for (const char* s : {__VA_ARGS__}) EXPECT_NE(std::string(e.what()).find(s), std::string::npos) \
          << "message lacks \"" << s << "\": " << e.what();                                    \
    }                                                                                          \
  } while (0)
