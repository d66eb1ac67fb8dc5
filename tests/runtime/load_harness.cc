#include "tests/runtime/load_harness.h"

namespace shardcast {

testing::TempDir* LoadTest::dir_ = nullptr;

}  // namespace shardcast
