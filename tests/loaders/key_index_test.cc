// KeyIndex: every key found at its position, a missing one not found, a duplicate keeping its first
// position, and keys that share their home slot (a table 2 to 4 times the keys collides often).
#include "loaders/key_index.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

namespace shardcast {
namespace {

struct Table {
  std::vector<std::string> keys;
  KeyIndex index;
  bool Build() { return index.Build(keys.size(), [&](size_t i) -> std::string_view { return keys[i]; }); }
  size_t Find(std::string_view k) const {
    return index.Find(k, [&](size_t i) -> std::string_view { return keys[i]; });
  }
};

TEST(KeyIndex, FindsEveryKeyAtItsPositionAndNothingElse) {
  Table t;
  for (int i = 0; i < 92000; ++i) t.keys.push_back("model.layers." + std::to_string(i / 256) + ".e." + std::to_string(i % 256));
  ASSERT_TRUE(t.Build());
  for (size_t i = 0; i < t.keys.size(); ++i) ASSERT_EQ(t.Find(t.keys[i]), i) << t.keys[i];
  EXPECT_EQ(t.Find("model.layers.0.e.256"), KeyIndex::npos);
  EXPECT_EQ(t.Find(""), KeyIndex::npos);
}

TEST(KeyIndex, ADuplicateKeepsItsFirstPositionAndIsReported) {
  Table t{{"b", "a", "b", "c"}, {}};
  EXPECT_FALSE(t.Build());
  EXPECT_EQ(t.Find("b"), 0u);
  EXPECT_EQ(t.Find("a"), 1u);
  EXPECT_EQ(t.Find("c"), 3u);
}

TEST(KeyIndex, EmptyTableAndUnbuiltIndexFindNothing) {
  Table unbuilt{{"x"}, {}};
  EXPECT_EQ(unbuilt.Find("x"), KeyIndex::npos);
  Table empty;
  EXPECT_TRUE(empty.Build());
  EXPECT_EQ(empty.Find("x"), KeyIndex::npos);
}

// The index holds positions, not pointers: a table copied with its index finds in the copy.
TEST(KeyIndex, ACopiedTableAndIndexFindInTheCopy) {
  Table t{{"x", "y", "z"}, {}};
  ASSERT_TRUE(t.Build());
  Table copy = t;
  copy.keys[1] = "w";  // the copy's own keys are what it compares
  EXPECT_EQ(copy.Find("z"), 2u);
  EXPECT_EQ(copy.Find("y"), KeyIndex::npos);
  EXPECT_EQ(t.Find("y"), 1u);
}

}  // namespace
}  // namespace shardcast
