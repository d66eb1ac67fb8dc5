// SHARDCAST_FAULT's parser: what a test may ask for, what is refused by name, and the switch without
// which nothing is ever armed.
#include <gtest/gtest.h>

#include "runtime/agree/fault.h"
#include "tests/loaders/test_util.h"

namespace shardcast {
namespace {

TEST(FaultSpec, AWellFormedValueArmsOnlyWithTheTestSwitch) {
  FaultSpec f = ParseFaultSpec("2:stream:kill:3", "1");
  EXPECT_TRUE(f.armed);
  EXPECT_EQ(f.rank, 2);
  EXPECT_EQ(f.point, "stream");
  EXPECT_EQ(f.action, "kill");
  EXPECT_EQ(f.nth, 3);
  EXPECT_EQ(ParseFaultSpec("0:save-commit:exit", "1").nth, 1);
  for (const char* off : {static_cast<const char*>(nullptr), "", "0", "yes", "true"}) {
    FaultSpec g = ParseFaultSpec("2:stream:kill:3", off);
    EXPECT_FALSE(g.armed) << (off ? off : "(unset)");
    EXPECT_TRUE(g.ignored);
  }
  EXPECT_FALSE(ParseFaultSpec(nullptr, "1").armed);
  EXPECT_FALSE(ParseFaultSpec("", "1").ignored);
}

TEST(FaultSpec, EveryMalformedValueIsNamed) {
  for (const char* v : {"1", "1:stream", "1:stream:kill:2:9", "x:stream:kill", "-1:stream:kill", "1:nowhere:kill",
                        "1:stream:boom", "1:stream:kill:0", "1:stream:kill:two", ":stream:kill"}) {
    SCOPED_TRACE(v);
    const std::string named = std::string("SHARDCAST_FAULT=\"") + v + "\"";
    EXPECT_SC_ERROR(ParseFaultSpec(v, "1"), ErrorKind::kInvalidArgument, named.c_str());
    EXPECT_FALSE(ParseFaultSpec(v, nullptr).armed);  // outside a test it is ignored, malformed or not
  }
}

}  // namespace
}  // namespace shardcast
