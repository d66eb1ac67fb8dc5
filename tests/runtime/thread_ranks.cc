#include "tests/runtime/thread_ranks.h"

#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>

#include <thread>
#include <vector>

#include "runtime/comm/c10d_communicator.h"

namespace shardcast::testing {

void RunThreadRanks(int world, const std::function<void(Communicator&)>& fn, std::chrono::milliseconds timeout) {
  auto store = c10::make_intrusive<c10d::HashStore>();
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      auto options = c10d::ProcessGroupGloo::Options::create(timeout);
      options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1"));
      auto prefixed = c10::make_intrusive<c10d::PrefixStore>("thread-ranks", store);
      auto pg = c10::make_intrusive<c10d::ProcessGroupGloo>(prefixed, r, world, options);
      auto comm = WrapC10dBackend(pg, timeout, prefixed);
      fn(*comm);
    });
  }
  for (auto& t : threads) t.join();
}

}  // namespace shardcast::testing
