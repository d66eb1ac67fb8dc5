// Symlinks in a checkpoint resolve beneath a root, or the checkpoint is bad input.
//
//   plain directory                      hub snapshot
//   <dir>/                 <- root       <cache>/models--org--name/        <- root
//     model.safetensors.index.json         blobs/<sha>
//     a.safetensors -> sub/a               snapshots/<rev>/                 <- the path given
//     b.safetensors -> /etc/passwd  BAD      a.safetensors -> ../../blobs/<sha>
//                                            b.safetensors -> ../../../elsewhere   BAD
//
// Both resolvers are tested: openat2(RESOLVE_BENEATH) where the kernel has it, and the
// component-by-component walk that stands in for it on older kernels.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <string>
#include <vector>

#include "loaders/checkpoint.h"
#include "loaders/posix_file.h"
#include "loaders/writer.h"
#include "tests/loaders/test_util.h"

namespace shardcast {
namespace {

void Small(const std::string& path, const std::string& key) {
  SafetensorsWriter w(path, {{key, DType::kU8, {2}}});
  w.Append("ab", 2);
  w.Commit();
}

void Link(const std::string& target, const std::string& link) {
  ASSERT_EQ(symlink(target.c_str(), link.c_str()), 0) << link << " -> " << target;
}

// ---- the resolver itself, both ways ------------------------------------------------------------

class Beneath : public ::testing::TestWithParam<BeneathResolver> {
 protected:
  void SetUp() override {
    if (GetParam() == BeneathResolver::kOpenat2 && !KernelHasOpenat2()) GTEST_SKIP() << "no openat2 in this kernel";
    // <root>/a.safetensors, <root>/sub/b (a regular file), <root>/../outside.bin
    ASSERT_EQ(mkdir((root_ / "r").c_str(), 0700), 0);
    ASSERT_EQ(mkdir((root_ / "r/sub").c_str(), 0700), 0);
    testing::WriteFile(root_ / "r/a.safetensors", "AAAA");
    testing::WriteFile(root_ / "r/sub/b", "BB");
    testing::WriteFile(root_ / "outside.bin", "SECRET");
    fd_ = UniqueFd(open((root_ / "r").c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
    ASSERT_GE(fd_.get(), 0);
  }
  std::string r(const std::string& name) const { return root_ / ("r/" + name); }
  std::optional<OpenNode> Open(const std::string& name) {
    return OpenNodeBeneath(fd_.get(), root_ / "r", name, r(name), GetParam());
  }
  std::string ReadAll(const OpenNode& n) {
    return ReadWholeFile(n.fd.get(), static_cast<uint64_t>(n.st.st_size), "test");
  }

  testing::TempDir root_;
  UniqueFd fd_;
};

TEST_P(Beneath, PlainNamesAndSymlinksThatStayInsideOpen) {
  Link("sub/b", r("rel"));
  Link("sub", r("dirlink"));
  Link("../a.safetensors", r("sub/up"));
  Link("../sub/./b", r("sub/around"));
  for (const auto& [name, want] : std::vector<std::pair<std::string, std::string>>{
           {"a.safetensors", "AAAA"}, {"sub/b", "BB"}, {"rel", "BB"}, {"dirlink/b", "BB"},
           {"sub/up", "AAAA"}, {"dirlink/up", "AAAA"}, {"sub/around", "BB"}, {"./sub/../a.safetensors", "AAAA"}}) {
    SCOPED_TRACE(name);
    std::optional<OpenNode> n = Open(name);
    ASSERT_TRUE(n.has_value());
    EXPECT_EQ(ReadAll(*n), want);
  }
}

TEST_P(Beneath, MissingNamesAreNullopt) {
  EXPECT_FALSE(Open("nope").has_value());
  EXPECT_FALSE(Open("sub/nope").has_value());
  EXPECT_FALSE(Open("a.safetensors/x").has_value());  // a component that is not a directory
  Link("gone", r("dangling"));
  EXPECT_FALSE(Open("dangling").has_value());
}

// Regression: any symlink was followed wherever it pointed.
TEST_P(Beneath, SymlinksThatEscapeTheRootAreCheckpointErrorsNamingTheFile) {
  Link(root_ / "outside.bin", r("abs"));
  Link("../outside.bin", r("up"));
  Link("../../outside.bin", r("sub/upup"));
  Link("..", r("sub/parent"));
  Link("/", r("slash"));
  for (const std::string name : {"abs", "up", "sub/upup", "sub/parent/up", "slash/etc/passwd", "../outside.bin"}) {
    SCOPED_TRACE(name);
    const std::string file = r(name), outside = "resolves outside " + root_ / "r";
    EXPECT_SC_ERROR(Open(name), ErrorKind::kCheckpoint, file.c_str(), outside.c_str());
  }
}

TEST_P(Beneath, ASymlinkLoopIsACheckpointErrorNotAnIoError) {
  Link("loop2", r("loop1"));
  Link("loop1", r("loop2"));
  Link("self", r("self"));
  for (const std::string name : {"loop1", "self", "self/x"}) {
    SCOPED_TRACE(name);
    const std::string file = r(name);
    EXPECT_SC_ERROR(Open(name), ErrorKind::kCheckpoint, file.c_str(), "symlink loop");
  }
}

INSTANTIATE_TEST_SUITE_P(Resolvers, Beneath, ::testing::Values(BeneathResolver::kOpenat2, BeneathResolver::kWalk),
                         [](const ::testing::TestParamInfo<BeneathResolver>& info) {
                           return info.param == BeneathResolver::kOpenat2 ? "Openat2" : "Walk";
                         });

// ---- Checkpoint::Open: the root it chooses -------------------------------------------------------

TEST(CheckpointRoot, PlainDirectoryFollowsLinksInsideAndRejectsLinksOutside) {
  testing::TempDir dir, outside;
  ASSERT_EQ(mkdir((dir / "shards").c_str(), 0700), 0);
  Small(dir / "shards/real-a.safetensors", "x");
  Small(outside / "b.safetensors", "y");
  Link("shards/real-a.safetensors", dir / "a.safetensors");
  Link(outside / "b.safetensors", dir / "b.safetensors");
  testing::WriteFile(dir / kIndexFileName, R"({"weight_map":{"x":"a.safetensors"}})");
  EXPECT_EQ(Checkpoint::Open(dir.path())->keys(), std::vector<std::string>{"x"});

  testing::WriteFile(dir / kIndexFileName, R"({"weight_map":{"x":"a.safetensors","y":"b.safetensors"}})");
  const std::string b = dir / "b.safetensors", outside_dir = "resolves outside " + dir.path();
  EXPECT_SC_ERROR(Checkpoint::Open(dir.path()), ErrorKind::kCheckpoint, b.c_str(), outside_dir.c_str());
}

TEST(CheckpointRoot, TheIndexAndTheSingleFileResolveBeneathTheDirectoryToo) {
  testing::TempDir dir, outside;
  testing::WriteFile(outside / "index.json", R"({"weight_map":{}})");
  Small(outside / "model.safetensors", "x");
  Link(outside / "index.json", dir / kIndexFileName);
  const std::string index = dir / kIndexFileName, single = dir / kSingleFileName;
  EXPECT_SC_ERROR(Checkpoint::Open(dir.path()), ErrorKind::kCheckpoint, index.c_str(), "resolves outside");
  ASSERT_EQ(unlink((dir / kIndexFileName).c_str()), 0);
  Link("../" + outside.path().substr(outside.path().rfind('/') + 1) + "/model.safetensors", dir / kSingleFileName);
  EXPECT_SC_ERROR(Checkpoint::Open(dir.path()), ErrorKind::kCheckpoint, single.c_str(), "resolves outside");
}

TEST(CheckpointRoot, ASymlinkLoopIsACheckpointError) {
  testing::TempDir dir;
  Link("b.safetensors", dir / "a.safetensors");
  Link("a.safetensors", dir / "b.safetensors");
  testing::WriteFile(dir / kIndexFileName, R"({"weight_map":{"x":"a.safetensors"}})");
  const std::string a = dir / "a.safetensors";
  EXPECT_SC_ERROR(Checkpoint::Open(dir.path()), ErrorKind::kCheckpoint, a.c_str(), "symlink loop");
}

// The path given may itself be a symlink (below), but one that loops is bad input, as a file's loop is:
// kCheckpoint (the CLI's exit 2), not an IoError.
TEST(CheckpointRoot, ADirectoryThatIsASymlinkToItselfIsACheckpointError) {
  testing::TempDir dir;
  Link(dir / "self", dir / "self");
  const std::string self = dir / "self";
  EXPECT_SC_ERROR(Checkpoint::Open(self), ErrorKind::kCheckpoint, self.c_str(), "symlink loop");
}

// A directory the path itself reaches through a symlink is the user's choice, and is the root.
TEST(CheckpointRoot, ThePathGivenMayItselfBeASymlink) {
  testing::TempDir dir, elsewhere;
  Small(elsewhere / kSingleFileName, "x");
  Link(elsewhere.path(), dir / "ckpt");
  EXPECT_EQ(Checkpoint::Open(dir / "ckpt")->keys(), std::vector<std::string>{"x"});
}

// A hub cache: <cache>/models--org--name/{blobs,snapshots/<rev>}. Links into ../../blobs are legal;
// links out of the repo folder are not, whether to another repo or anywhere else.
class HubCache {
 public:
  HubCache() {
    EXPECT_EQ(std::system(("mkdir -p '" + repo() + "/blobs' '" + snapshot() + "' '" + cache_ / "models--evil--x/blobs" + "'").c_str()), 0);
  }
  std::string repo() const { return cache_ / "models--org--name"; }
  std::string snapshot() const { return repo() + "/snapshots/abc123"; }
  std::string cache(const std::string& name) const { return cache_ / name; }

 private:
  testing::TempDir cache_;
};

TEST(CheckpointRoot, HubSnapshotLinksIntoBlobsOpenAndLinksOutOfTheRepoAreRejected) {
  HubCache hub;
  Small(hub.repo() + "/blobs/sha-a", "x");
  Small(hub.cache("models--evil--x/blobs/sha-b"), "y");
  Link("../../blobs/sha-a", hub.snapshot() + "/a.safetensors");
  Link("../../../models--evil--x/blobs/sha-b", hub.snapshot() + "/b.safetensors");
  testing::WriteFile(hub.snapshot() + "/" + kIndexFileName, R"({"weight_map":{"x":"a.safetensors"}})");
  EXPECT_EQ(Checkpoint::Open(hub.snapshot())->keys(), std::vector<std::string>{"x"});
  EXPECT_EQ(Checkpoint::Open(hub.snapshot() + "/")->keys(), std::vector<std::string>{"x"});

  testing::WriteFile(hub.snapshot() + "/" + kIndexFileName, R"({"weight_map":{"x":"a.safetensors","y":"b.safetensors"}})");
  const std::string b = hub.snapshot() + "/b.safetensors", outside_repo = "resolves outside " + hub.repo();
  EXPECT_SC_ERROR(Checkpoint::Open(hub.snapshot()), ErrorKind::kCheckpoint, b.c_str(), outside_repo.c_str());
}

// Only the hub's layout widens the root: a directory merely named "snapshots" elsewhere does not.
TEST(CheckpointRoot, ADirectoryThatOnlyLooksLikeASnapshotKeepsItsOwnRoot) {
  HubCache hub;
  const std::string fake = hub.cache("not-a-repo/snapshots/rev");
  ASSERT_EQ(std::system(("mkdir -p '" + fake + "'").c_str()), 0);
  Small(hub.cache("not-a-repo/blob"), "x");
  Link("../../blob", fake + "/" + kSingleFileName);
  EXPECT_SC_ERROR(Checkpoint::Open(fake), ErrorKind::kCheckpoint, "outside");
}

}  // namespace
}  // namespace shardcast
