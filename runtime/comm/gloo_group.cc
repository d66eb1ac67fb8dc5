#include "runtime/comm/gloo_group.h"

#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include <cstdlib>
#include <memory>
#include <type_traits>

#include "runtime/comm/store_channel.h"

namespace shardcast {
namespace {

// The store a lazy group reads its peers' addresses from, every request within `deadline`. A lazy pair
// connects on its first use, inside a collective or on the caller's thread in a send or receive, and
// reads the peer's address then: a frozen store host must not hold that thread past the operation's
// timeout (the caller's store waits its own timeout: 30 min by torch's default). A request past its
// deadline throws a timeout (kCommTimeout at the communicator); its thread, abandoned, holds only the
// store and copies of its arguments.
class DeadlineStore : public c10d::PrefixStore {
 public:
  DeadlineStore(c10::intrusive_ptr<c10d::Store> store, std::chrono::milliseconds deadline)
      : PrefixStore("gloo", std::move(store)), deadline_(deadline) {}

  void set(const std::string& key, const std::vector<uint8_t>& value) override {
    Within<bool>("set of " + key, [s = store_, k = joinKey(key), value] { return s->set(k, value), true; });
  }
  std::vector<uint8_t> get(const std::string& key) override {
    return Within<std::vector<uint8_t>>("get of " + key, [s = store_, k = joinKey(key)] { return s->get(k); });
  }
  std::vector<std::vector<uint8_t>> multiGet(const std::vector<std::string>& keys) override {
    return Within<std::vector<std::vector<uint8_t>>>("multi_get",
                                                     [s = store_, k = joinKeys(keys)] { return s->multiGet(k); });
  }
  void wait(const std::vector<std::string>& keys) override { wait(keys, deadline_); }
  void wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& timeout) override {
    const std::chrono::milliseconds t = std::min(timeout, deadline_);
    Within<bool>("wait", [s = store_, k = joinKeys(keys), t] { return s->wait(k, t), true; });
  }

 private:
  template <typename T>
  T Within(const std::string& what, std::function<T()> op) {
    std::optional<T> r = WithDeadline(std::move(op), deadline_);
    if (!r) {
      C10_THROW_ERROR(DistStoreError, "the rendezvous store did not answer a " + what + " within " +
                                          std::to_string(deadline_.count()) + " ms (timed out)");
    }
    return std::move(*r);
  }
  std::chrono::milliseconds deadline_;
};

// Whether this torch's Gloo devices take gloo's lazy init (`lazyInit`, a later torch than 2.6, the oldest
// shardcast builds against): told by the signature, not by a version number.
template <typename PG, typename = void>
struct LazyInitIn : std::false_type {};
template <typename PG>
struct LazyInitIn<PG, std::void_t<decltype(PG::createDeviceForHostname(std::string(), true))>> : std::true_type {};

// The device of the group: GLOO_SOCKET_IFNAME's interface, else loopback where the store host is, else the
// host name's. A template, so that the calls with `lazy` compile only where the torch has them.
template <typename PG>
std::shared_ptr<::gloo::transport::Device> DeviceFor(const std::string& master_addr, bool lazy) {
  const char* ifname = std::getenv("GLOO_SOCKET_IFNAME");
  const bool loopback = master_addr == "127.0.0.1" || master_addr == "localhost";
  if constexpr (LazyInitIn<PG>::value) {
    if (ifname != nullptr) return PG::createDeviceForInterface(ifname, lazy);
    return loopback ? PG::createDeviceForHostname("127.0.0.1", lazy) : PG::createDefaultDevice(lazy);
  } else {
    (void)lazy;  // a full mesh
    if (ifname != nullptr) return PG::createDeviceForInterface(ifname);
    return loopback ? PG::createDeviceForHostname("127.0.0.1") : PG::createDefaultDevice();
  }
}

}  // namespace

c10::intrusive_ptr<c10d::Backend> MakeGlooGroup(const c10::intrusive_ptr<c10d::Store>& store, int rank, int world_size,
                                                std::chrono::milliseconds timeout, const std::string& master_addr,
                                                GlooConnect connect) {
  const bool lazy = connect == GlooConnect::kLazy && LazyInitIn<c10d::ProcessGroupGloo>::value;
  auto options = c10d::ProcessGroupGloo::Options::create(timeout);
  options->devices.push_back(DeviceFor<c10d::ProcessGroupGloo>(master_addr, lazy));
  c10::intrusive_ptr<c10d::Store> gloo_store = store;
  if (lazy) gloo_store = c10::make_intrusive<DeadlineStore>(store, timeout);
  return c10::make_intrusive<c10d::ProcessGroupGloo>(gloo_store, rank, world_size, options);
}

}  // namespace shardcast
