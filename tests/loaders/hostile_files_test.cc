// Checkpoint directories whose files are not what they claim: FIFOs, sockets, devices and
// directories where a regular file belongs. Every one must be a prompt kCheckpoint error naming the
// path and what it is. Anything that could block runs in a child with a deadline, so a regression
// fails the test instead of hanging it.
#include <gtest/gtest.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <chrono>
#include <string>
#include <vector>

#include "loaders/checkpoint.h"
#include "loaders/model_spec.h"
#include "loaders/writer.h"
#include "tests/loaders/test_util.h"

namespace shardcast {
namespace {

using testing::ChildOutcome;
using testing::RunInChild;

constexpr auto kDeadline = std::chrono::seconds(10);  // a correct open takes milliseconds

void Small(const std::string& path, const std::vector<std::string>& keys) {
  std::vector<WriteEntry> entries;
  for (const auto& k : keys) entries.push_back({k, DType::kU8, {2}});
  SafetensorsWriter w(path, entries);
  for (size_t i = 0; i < keys.size(); ++i) w.Append("ab", 2);
  w.Commit();
}

// Opens `path` in a child and expects a prompt kCheckpoint error naming `name` and `what`.
void ExpectPromptRejection(const std::string& path, const std::string& name, const std::string& what) {
  ChildOutcome o = RunInChild(
      [&] {
        auto c = Checkpoint::Open(path);
        return "opened with " + std::to_string(c->num_files()) + " file(s)";
      },
      kDeadline);
  ASSERT_EQ(o.state, ChildOutcome::kThrewError) << o.Describe();
  EXPECT_EQ(o.kind, ErrorKind::kCheckpoint) << o.Describe();
  EXPECT_NE(o.message.find(name), std::string::npos) << "lacks \"" << name << "\": " << o.message;
  EXPECT_NE(o.message.find(what), std::string::npos) << "lacks \"" << what << "\": " << o.message;
}

// The roles a FIFO can take: the path given, the single file, the index, a file the index names.
enum class FifoRole { kPathItself, kSingleFile, kIndex, kWeightMapTarget };

class FifoIn : public ::testing::TestWithParam<FifoRole> {};

// Regression: open() of a FIFO blocks until a writer appears, so each of these hung the loader.
TEST_P(FifoIn, EveryRoleIsRejectedWithoutBlocking) {
  testing::TempDir dir;
  std::string fifo, open_path = dir.path();
  switch (GetParam()) {
    case FifoRole::kPathItself:
      fifo = dir / "lone.safetensors";
      open_path = fifo;
      break;
    case FifoRole::kSingleFile:
      fifo = dir / kSingleFileName;
      break;
    case FifoRole::kIndex:
      fifo = dir / kIndexFileName;  // no model.safetensors, which Open would read first (transformers' order)
      break;
    case FifoRole::kWeightMapTarget:
      fifo = dir / "b.safetensors";
      Small(dir / "a.safetensors", {"x"});
      testing::WriteFile(dir / kIndexFileName, R"({"weight_map":{"x":"a.safetensors","y":"b.safetensors"}})");
      break;
  }
  ASSERT_EQ(mkfifo(fifo.c_str(), 0600), 0);
  ExpectPromptRejection(open_path, fifo, "is a FIFO");
}

INSTANTIATE_TEST_SUITE_P(Roles, FifoIn,
                         ::testing::Values(FifoRole::kPathItself, FifoRole::kSingleFile, FifoRole::kIndex, FifoRole::kWeightMapTarget),
                         [](const ::testing::TestParamInfo<FifoRole>& info) {
                           switch (info.param) {
                             case FifoRole::kPathItself: return "PathItself";
                             case FifoRole::kSingleFile: return "SingleFile";
                             case FifoRole::kIndex: return "Index";
                             case FifoRole::kWeightMapTarget: return "WeightMapTarget";
                           }
                           return "Unknown";
                         });

// Binds a Unix socket at path (left bound until the test ends).
int BindSocket(const std::string& path) {
  int s = socket(AF_UNIX, SOCK_STREAM, 0);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (path.size() >= sizeof(addr.sun_path)) return -1;
  std::copy(path.begin(), path.end(), addr.sun_path);
  if (bind(s, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    ::close(s);
    return -1;
  }
  return s;
}

TEST(NonRegularFile, NamedByTheWeightMapIsRejectedSayingWhatItIs) {
  testing::TempDir dir;
  Small(dir / "a.safetensors", {"x"});
  testing::WriteFile(dir / kIndexFileName, R"({"weight_map":{"x":"a.safetensors","y":"b.safetensors"}})");
  const std::string b = dir / "b.safetensors";

  int sock = BindSocket(b);
  ASSERT_GE(sock, 0) << "cannot bind a socket at " << b;
  ExpectPromptRejection(dir.path(), b, "is a socket");
  ::close(sock);
  ASSERT_EQ(unlink(b.c_str()), 0);

  // A device outside the directory is not even opened: the symlink escapes the root.
  ASSERT_EQ(symlink("/dev/null", b.c_str()), 0);
  ExpectPromptRejection(dir.path(), b, "resolves outside");
  ASSERT_EQ(unlink(b.c_str()), 0);

  ASSERT_EQ(mkdir(b.c_str(), 0700), 0);
  ExpectPromptRejection(dir.path(), b, "is a directory");
}

TEST(NonRegularFile, TheIndexAsADirectoryIsRejected) {
  testing::TempDir dir;
  ASSERT_EQ(mkdir((dir / kIndexFileName).c_str(), 0700), 0);
  ExpectPromptRejection(dir.path(), dir / kIndexFileName, "is a directory");
}

TEST(NonRegularFile, SafetensorsFileOpenOfAFifoDoesNotBlock) {
  testing::TempDir dir;
  const std::string fifo = dir / "f.safetensors";
  ASSERT_EQ(mkfifo(fifo.c_str(), 0600), 0);
  ChildOutcome o = RunInChild(
      [&] {
        SafetensorsFile::Open(fifo);
        return std::string("opened");
      },
      kDeadline);
  ASSERT_EQ(o.state, ChildOutcome::kThrewError) << o.Describe();
  EXPECT_EQ(o.kind, ErrorKind::kCheckpoint) << o.Describe();
  EXPECT_NE(o.message.find(fifo + ": is a FIFO, not a regular file"), std::string::npos) << o.message;
}

}  // namespace
}  // namespace shardcast


namespace shardcast {
namespace {

// Regression: config.json was read with std::ifstream, so a FIFO there (a checkpoint's config.json
// is read by `shardcast load`) blocked forever, and a directory read as an empty file.
TEST(NonRegularFile, ConfigJsonThatIsAFifoOrDirectoryIsAPromptConfigError) {
  testing::TempDir dir;
  const std::string fifo = dir / "config.json", sub = dir / "sub.json";
  ASSERT_EQ(mkfifo(fifo.c_str(), 0600), 0);
  ASSERT_EQ(mkdir(sub.c_str(), 0700), 0);
  for (const auto& [path, what] : {std::pair{fifo, "is a FIFO"}, std::pair{sub, "is a directory"}}) {
    ChildOutcome o = RunInChild(
        [&, p = path] {
          BuildModelSpec(p);
          return std::string("built a spec");
        },
        kDeadline);
    ASSERT_EQ(o.state, ChildOutcome::kThrewError) << o.Describe();
    EXPECT_EQ(o.kind, ErrorKind::kConfig) << o.Describe();
    EXPECT_NE(o.message.find(path + ": " + what + ", not a regular file"), std::string::npos) << o.Describe();
  }
}

}  // namespace
}  // namespace shardcast
