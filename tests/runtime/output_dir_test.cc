// runtime/engine/file_sink.h's output_dir: a save's build is held from the instant it exists, so another
// save's Leftovers() never lists it for removal, and lists it once the save that made it let go.
#include <gtest/gtest.h>

#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <string>

#include "allocators/error.h"
#include "runtime/engine/file_sink.h"

namespace shardcast {
namespace {

namespace fs = std::filesystem;

std::string Scratch(const std::string& name) {
  const fs::path p = fs::temp_directory_path() / ("shardcast-output-dir-" + std::to_string(::getpid()) + "-" + name);
  fs::remove_all(p);
  fs::create_directories(p);
  return p.string();
}

TEST(OutputDir, ABuildIsHeldFromCreationAndLeftOverOnceLetGo) {
  const std::string parent = Scratch("held");
  const std::string out = parent + "/out", build = parent + "/out.tmp-1";
  {
    output_dir::BuildHold hold = output_dir::Create(build, {}, {});
    EXPECT_TRUE(fs::is_directory(build));
    EXPECT_TRUE(output_dir::Held(build));
    EXPECT_TRUE(output_dir::Leftovers(out).empty());
    for (const auto& e : fs::directory_iterator(parent)) {
      EXPECT_EQ(e.path().filename().string(), "out.tmp-1") << "left beside the build: " << e.path();
    }
  }
  EXPECT_FALSE(output_dir::Held(build));
  ASSERT_EQ(output_dir::Leftovers(out).size(), 1u);
  EXPECT_EQ(output_dir::Leftovers(out)[0], build);
  fs::remove_all(parent);
}

TEST(OutputDir, ABuildThatExistsIsRefusedNamingItAndLeavesNothingBehind) {
  const std::string parent = Scratch("exists");
  const std::string build = parent + "/out.tmp-2";
  fs::create_directories(build);
  try {
    output_dir::Create(build, {}, {});
    FAIL() << "an existing build directory was taken over";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(build), std::string::npos) << e.what();
  }
  for (const auto& e : fs::directory_iterator(parent)) {
    EXPECT_EQ(e.path().filename().string(), "out.tmp-2") << "left beside the build: " << e.path();
  }
  fs::remove_all(parent);
}

// A save killed between making its build under the hidden name and renaming it leaves that name behind: swept
// once it is over a minute old and unheld, never while a live save may be making it.
TEST(OutputDir, AHiddenBuildLeftByAKilledSaveIsLeftOverOnceStale) {
  const std::string parent = Scratch("making");
  const std::string out = parent + "/out", making = parent + "/.out.tmp-4.making";
  fs::create_directories(making);
  EXPECT_TRUE(output_dir::Leftovers(out).empty()) << "a fresh hidden build counted as left over";
  const fs::file_time_type old = fs::last_write_time(making) - std::chrono::minutes(2);
  fs::last_write_time(making, old);
  {
    output_dir::BuildHold hold(making);
    EXPECT_TRUE(output_dir::Leftovers(out).empty()) << "a held hidden build counted as left over";
  }
  ASSERT_EQ(output_dir::Leftovers(out).size(), 1u);
  EXPECT_EQ(output_dir::Leftovers(out)[0], making);
  fs::create_directories(parent + "/.other.tmp-4.making");  // another out_dir's: not this one's
  fs::last_write_time(parent + "/.other.tmp-4.making", old);
  EXPECT_EQ(output_dir::Leftovers(out).size(), 1u);
  EXPECT_EQ(output_dir::Check(out, /*overwrite=*/true).size(), 1u);
  fs::remove_all(parent);
}

}  // namespace
}  // namespace shardcast
