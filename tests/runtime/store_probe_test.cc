// The probe that tells a dead store host from a frozen one (runtime/comm/store_channel.h: StoreRefuses,
// StoreUnanswered), on real sockets: a port that listens (a frozen host's kernel still queues connects) is
// not refused, a port nothing listens on is, and an address not known is never taken as refused.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "allocators/error.h"
#include "runtime/comm/store_channel.h"

namespace shardcast {
namespace {

// A loopback TCP socket bound to a port of its own, listening or not; closed by the destructor.
class Socket {
 public:
  explicit Socket(bool listening) : fd_(socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0)) {
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof(a);
    EXPECT_GE(fd_, 0);
    EXPECT_EQ(bind(fd_, reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0);
    if (listening) {
      EXPECT_EQ(listen(fd_, 16), 0);
    }
    EXPECT_EQ(getsockname(fd_, reinterpret_cast<sockaddr*>(&a), &len), 0);
    port_ = ntohs(a.sin_port);
  }
  ~Socket() { Close(); }
  void Close() {
    if (fd_ >= 0) close(fd_);
    fd_ = -1;
  }
  int port() const { return port_; }

 private:
  int fd_;
  int port_ = 0;
};

TEST(StoreProbe, AListeningPortIsNotRefused) {
  Socket s(/*listening=*/true);  // never accepts: as a frozen store host, whose kernel still queues connects
  EXPECT_FALSE(StoreRefuses({"127.0.0.1", s.port()}));
  EXPECT_FALSE(StoreRefuses({"localhost", s.port()}));  // a name: every address it has must refuse
  const FailureNote n = StoreUnanswered("rank 0 (the store host)", {"127.0.0.1", s.port()});
  EXPECT_EQ(n.kind, ErrorKind::kCommTimeout);
  EXPECT_EQ(n.message, "rank 0 (the store host) did not answer: it is frozen or unreachable");
}

TEST(StoreProbe, APortNothingListensOnIsRefused) {
  Socket s(/*listening=*/true);
  const int port = s.port();
  s.Close();  // as a store host that died: its port closed with it
  EXPECT_TRUE(StoreRefuses({"127.0.0.1", port}));
  const FailureNote n = StoreUnanswered("rank 0 (the store host)", {"127.0.0.1", port});
  EXPECT_EQ(n.kind, ErrorKind::kComm);
  EXPECT_EQ(n.message,
            "rank 0 (the store host) is lost: its connection closed or its port refuses connections");
  Socket bound(/*listening=*/false);  // bound, not listening: refused too
  EXPECT_TRUE(StoreRefuses({"127.0.0.1", bound.port()}));
}

TEST(StoreProbe, AnAddressNotKnownIsNeverRefused) {
  EXPECT_FALSE(StoreRefuses({}));
  EXPECT_FALSE(StoreRefuses({"127.0.0.1", -1}));
  EXPECT_FALSE(StoreRefuses({"127.0.0.1", 70000}));
  EXPECT_FALSE(StoreRefuses({"no-such-host.invalid", 29500}));
  EXPECT_EQ(StoreUnanswered("the process group's store", {}).kind, ErrorKind::kCommTimeout);
}

TEST(StoreProbe, ANameIsResolvedOnceToTheAddressesTheProbeThenUses) {
  const StoreAddress named = Resolved({"localhost", 29500});
  EXPECT_EQ(named.addr, "localhost");
  EXPECT_NE(std::find(named.numeric.begin(), named.numeric.end(), "127.0.0.1"), named.numeric.end());
  EXPECT_EQ(Resolved({"127.0.0.1", 29500}).numeric, std::vector<std::string>{"127.0.0.1"});  // its own
  EXPECT_EQ(Resolved({"localhost", 29500}).numeric, named.numeric);  // the same again (cached or not)
  EXPECT_TRUE(Resolved({"no-such-host.invalid", 29500}).numeric.empty());  // resolved when probed, as before
  EXPECT_TRUE(Resolved({"localhost", -1}).numeric.empty());

  // Once resolved, the probe asks no name service: a name none knows, with its addresses kept, still probes.
  Socket listening(/*listening=*/true);
  EXPECT_FALSE(StoreRefuses({"no-such-host.invalid", listening.port(), {"127.0.0.1"}}));
  Socket closed(/*listening=*/true);
  const int port = closed.port();
  closed.Close();
  EXPECT_TRUE(StoreRefuses({"no-such-host.invalid", port, {"127.0.0.1"}}));
  EXPECT_FALSE(StoreRefuses({"no-such-host.invalid", port}));  // unresolved, the name decides: unknown
  // Every kept address must refuse: one that listens is a store host that answers.
  EXPECT_FALSE(StoreRefuses({"no-such-host.invalid", listening.port(), {"127.0.0.2", "127.0.0.1"}}));
  EXPECT_TRUE(StoreRefuses({"no-such-host.invalid", listening.port(), {"127.0.0.2"}}));  // not listening there
}

}  // namespace
}  // namespace shardcast

namespace shardcast {
namespace {

// The store's lists of ranks that came to a step: each entry once a time it came, anything else passed over.
TEST(StoreLists, CountTheTimesEachRankCame) {
  EXPECT_EQ(TimesOn("0 2 1 0 x -1 7 2 ", 3), (std::vector<int>{2, 1, 2}));
  EXPECT_EQ(TimesOn("", 2), (std::vector<int>{0, 0}));
  EXPECT_TRUE(TimesOn("0 1 ", 0).empty());
}

}  // namespace
}  // namespace shardcast
