// python/carried: the problem a rank carries into a load's or save's agreement, so that every rank raises it
// instead of waiting. Not thread-safe: one per operation, used with the GIL.
#pragma once

#include <exception>
#include <optional>
#include <string>

#include "allocators/error.h"

namespace shardcast::binding {

// This rank's first failure before the agreement, kept until the load's or save's first verdict
// (FailLoad/FailSave), which raises it on every rank. Every exception counts: a shardcast::Error keeps
// its kind; anything else (a pybind11::cast_error, a Python exception raised while converting a value,
// a std::exception from the core) is an InvalidArgument naming the argument. Nothing escapes here on
// one rank alone: its peers would wait out the rendezvous and raise a CommTimeout that names no cause.
// The verdict names the rank.
class Carried {
 public:
  // Runs `step`, even where this rank already failed (the options' timeout still shapes the
  // communicator); the first failure is the one carried. Whether `step` succeeded.
  template <typename F>
  bool Run(const std::string& argument, F&& step) {
    try {
      step();
      return true;
    } catch (const Error& e) {
      Take(e);
    } catch (const std::exception& e) {
      Take(Error(ErrorKind::kInvalidArgument, argument, e.what()));
    }
    return false;
  }
  void Take(const Error& e) {
    if (!error_) error_ = e;
  }
  const std::optional<Error>& error() const { return error_; }

 private:
  std::optional<Error> error_;
};

}  // namespace shardcast::binding
