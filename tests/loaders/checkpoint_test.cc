#include "loaders/checkpoint.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <unistd.h>

#include "loaders/writer.h"
#include "tests/loaders/test_util.h"

namespace shardcast {
namespace {

void Small(const std::string& path, const std::vector<std::string>& keys) {
  std::vector<WriteEntry> entries;
  for (const auto& k : keys) entries.push_back({k, DType::kU8, {2}});
  SafetensorsWriter w(path, entries);
  for (size_t i = 0; i < keys.size(); ++i) w.Append("ab", 2);
  w.Commit();
}

TEST(Checkpoint, OpensSingleFileDirAndPlainFile) {
  testing::TempDir dir;
  Small(dir / "model.safetensors", {"x", "y"});
  EXPECT_EQ(Checkpoint::Open(dir.path())->keys(), (std::vector<std::string>{"x", "y"}));
  EXPECT_EQ(Checkpoint::Open(dir / "model.safetensors")->num_files(), 1u);
}

// A directory holding both model.safetensors and an index (an output written over, a repo re-saved in one
// file) loads model.safetensors, as transformers does: shardcast read the index's files, other weights.
TEST(Checkpoint, ModelSafetensorsWinsOverAnIndexBesideIt) {
  testing::TempDir dir;
  Small(dir / "model.safetensors", {"fresh"});
  Small(dir / "model-00001-of-00001.safetensors", {"stale"});
  testing::WriteFile(dir / kIndexFileName, R"({"weight_map":{"stale":"model-00001-of-00001.safetensors"}})");
  const auto c = Checkpoint::Open(dir.path());
  EXPECT_EQ(c->keys(), (std::vector<std::string>{"fresh"}));
  EXPECT_EQ(ProbeCheckpoint(dir.path()), static_cast<int64_t>(std::filesystem::file_size(dir / "model.safetensors")));
}

// A second rank's setup: the files rank 0 named, no index read, and no header parsed again when its
// digest is the one rank 0 validated; any other header is parsed (and so validated) in full.
TEST(Checkpoint, OpenKnownParsesOnlyHeadersItDoesNotKnow) {
  testing::TempDir dir;
  Small(dir / "model.safetensors", {"x", "y"});
  const auto first = Checkpoint::Open(dir.path());
  const SafetensorsFile& f = first->file(0);
  const Checkpoint::KnownFile known{"model.safetensors", f.file_size(), f.header_digest()};
  for (const std::string& path : {dir.path(), dir / "model.safetensors"}) {
    const auto second = Checkpoint::OpenKnown(path, {known});
    ASSERT_EQ(second->num_files(), 1u);
    EXPECT_EQ(second->file(0).header_digest(), f.header_digest());
    EXPECT_EQ(second->file(0).file_size(), f.file_size());
    EXPECT_TRUE(second->file(0).header().tensors.empty()) << path << ": a known header was parsed again";
    EXPECT_TRUE(second->keys().empty());
  }
  Checkpoint::KnownFile other = known;
  other.digest ^= 1;  // what another checkpoint's rank 0 saw: this header is parsed
  EXPECT_EQ(Checkpoint::OpenKnown(dir.path(), {other})->file(0).header().tensors.size(), 2u);
  other.name = "missing.safetensors";
  EXPECT_THROW(Checkpoint::OpenKnown(dir.path(), {other}), Error);
}

TEST(Checkpoint, RejectsBadIndexes) {
  testing::TempDir dir;
  Small(dir / "a.safetensors", {"x"});
  Small(dir / "b.safetensors", {"x", "y"});
  const std::string index = dir / kIndexFileName;
  auto with = [&](const std::string& json) {
    testing::WriteFile(index, json);
    return dir.path();
  };
  EXPECT_SC_ERROR(Checkpoint::Open(with("{")), ErrorKind::kCheckpoint, "not valid JSON", index.c_str());
  EXPECT_SC_ERROR(Checkpoint::Open(with(R"({"metadata":{}})")), ErrorKind::kCheckpoint, "no \"weight_map\"");
  EXPECT_SC_ERROR(Checkpoint::Open(with(R"({"weight_map":{"x":"a.safetensors","x":"b.safetensors"}})")),
                  ErrorKind::kCheckpoint, "duplicate key 'x'");
  EXPECT_SC_ERROR(Checkpoint::Open(with(R"({"weight_map":{"x":"../a.safetensors"}})")), ErrorKind::kCheckpoint,
                  "weight_map['x']", "escapes the checkpoint directory");
  EXPECT_SC_ERROR(Checkpoint::Open(with(R"({"weight_map":{"x":"/etc/passwd"}})")), ErrorKind::kCheckpoint,
                  "absolute path");
  EXPECT_SC_ERROR(Checkpoint::Open(with(R"({"weight_map":{"x":"gone.safetensors"}})")), ErrorKind::kCheckpoint,
                  "\"gone.safetensors\", which does not exist");
  EXPECT_SC_ERROR(Checkpoint::Open(with(R"({"weight_map":{"x":7}})")), ErrorKind::kCheckpoint, "not a file name");
  EXPECT_SC_ERROR(Checkpoint::Open(with(R"({"weight_map":{"z":"a.safetensors"}})")), ErrorKind::kCheckpoint,
                  "holds no tensor 'z'");
  EXPECT_SC_ERROR(Checkpoint::Open(with(R"({"weight_map":{"x":"a.safetensors","y":"b.safetensors"}})")),
                  ErrorKind::kCheckpoint, "tensor 'x' is also in", "unique across files");
  EXPECT_SC_ERROR(Checkpoint::Open(with(R"({"weight_map":{"x":"sub/../a.safetensors"}})")), ErrorKind::kCheckpoint,
                  "escapes the checkpoint directory");  // even one that would land inside
  EXPECT_SC_ERROR(Checkpoint::Open(with(R"({"weight_map":{"x":""}})")), ErrorKind::kCheckpoint, "empty file name");
  EXPECT_SC_ERROR(Checkpoint::Open(with(R"({"weight_map":{"x":"a.safetensors\u0000.txt"}})")),
                  ErrorKind::kCheckpoint, "contains NUL");
  auto ok = Checkpoint::Open(with(R"({"weight_map":{"x":"a.safetensors"}})"));
  EXPECT_EQ(ok->Get("x").file->path(), dir / "a.safetensors");
  EXPECT_SC_ERROR(ok->Get("nope"), ErrorKind::kCheckpoint, "no tensor 'nope'");
}

// Keys are found through one index over every file's tensors, in key order: key_index is the key's
// position in keys(), whichever file holds it.
TEST(Checkpoint, FindsEveryKeyOfEveryFileAtItsPositionInKeyOrder) {
  testing::TempDir dir;
  Small(dir / "a.safetensors", {"d", "b"});
  Small(dir / "b.safetensors", {"e", "a", "c"});
  testing::WriteFile(dir / kIndexFileName,
                     R"({"weight_map":{"d":"a.safetensors","b":"a.safetensors","e":"b.safetensors",)"
                     R"("a":"b.safetensors","c":"b.safetensors"}})");
  for (const auto& ckpt : {Checkpoint::Open(dir.path()), Checkpoint::Open(dir.path() + "/")}) {
    ASSERT_EQ(ckpt->keys(), (std::vector<std::string>{"a", "b", "c", "d", "e"}));
    ASSERT_EQ(ckpt->num_keys(), 5u);
    for (size_t i = 0; i < ckpt->num_keys(); ++i) {
      const Checkpoint::Entry* e = ckpt->Find(ckpt->key(i));
      ASSERT_NE(e, nullptr) << ckpt->key(i);
      EXPECT_EQ(e->key_index, i);
      EXPECT_EQ(e->info->key, ckpt->key(i));
      // the directory as given, "/" included: compared as paths, not as text
      EXPECT_EQ(std::filesystem::path(e->file->path()).lexically_normal(),
                std::filesystem::path(dir / (ckpt->key(i) == "b" || ckpt->key(i) == "d" ? "a.safetensors"
                                                                                        : "b.safetensors")));
    }
    EXPECT_EQ(ckpt->Find("f"), nullptr);
    EXPECT_EQ(ckpt->Find(""), nullptr);
  }
}

// An index that leaves out a tensor its files hold: the tensor is still a key, found in its file.
TEST(Checkpoint, ATensorTheIndexLeavesOutIsStillAKey) {
  testing::TempDir dir;
  Small(dir / "a.safetensors", {"y", "x"});
  testing::WriteFile(dir / kIndexFileName, R"({"weight_map":{"x":"a.safetensors"}})");
  auto ckpt = Checkpoint::Open(dir.path());
  EXPECT_EQ(ckpt->keys(), (std::vector<std::string>{"x", "y"}));
  EXPECT_EQ(ckpt->Get("y").file->path(), dir / "a.safetensors");
  EXPECT_EQ(ckpt->Get("y").key_index, 1u);
}

// A key in two files is named (with both files) before a pair naming a file that lacks its key: the
// order of the problems is the one Open always had.
TEST(Checkpoint, AKeyInTwoFilesIsNamedBeforeAPairWhoseFileLacksItsKey) {
  testing::TempDir dir;
  Small(dir / "a.safetensors", {"q"});
  Small(dir / "b.safetensors", {"x", "q"});
  testing::WriteFile(dir / kIndexFileName, R"({"weight_map":{"q":"b.safetensors","x":"a.safetensors"}})");
  const std::string a = dir / "a.safetensors", b = dir / "b.safetensors";  // named: the macro keeps pointers
  EXPECT_SC_ERROR(Checkpoint::Open(dir.path()), ErrorKind::kCheckpoint, "tensor 'q' is also in", a.c_str(), b.c_str());
  Small(dir / "b.safetensors", {"x"});  // now no key is in two files: the pair is the problem
  EXPECT_SC_ERROR(Checkpoint::Open(dir.path()), ErrorKind::kCheckpoint, "weight_map['q']", "holds no tensor 'q'");
}

// Symlinks inside the directory are followed, a directory's too; where one leads outside is
// symlink_root_test.cc's (issue 20: they were followed anywhere).
TEST(Checkpoint, FollowsSymlinksThatStayInsideTheDirectory) {
  testing::TempDir dir;
  ASSERT_EQ(mkdir((dir / "real").c_str(), 0700), 0);
  Small(dir / "real/x.safetensors", {"x"});
  Small(dir / "real/y.safetensors", {"y"});
  ASSERT_EQ(symlink("real/x.safetensors", (dir / "link.safetensors").c_str()), 0);
  ASSERT_EQ(symlink("real", (dir / "sub").c_str()), 0);
  testing::WriteFile(dir / kIndexFileName, R"({"weight_map":{"x":"link.safetensors","y":"sub/y.safetensors"}})");
  auto ckpt = Checkpoint::Open(dir.path());
  EXPECT_EQ(ckpt->keys(), (std::vector<std::string>{"x", "y"}));
  EXPECT_EQ(ckpt->Get("x").file->path(), dir / "link.safetensors");
  EXPECT_EQ(ckpt->Get("y").file->path(), dir / "sub/y.safetensors");
}

TEST(Checkpoint, EmptyDirectoryAndMissingPath) {
  testing::TempDir dir;
  EXPECT_SC_ERROR(Checkpoint::Open(dir.path()), ErrorKind::kCheckpoint, "holds neither");
  EXPECT_SC_ERROR(Checkpoint::Open(dir / "nothing"), ErrorKind::kCheckpoint, "no such file");
}

}  // namespace
}  // namespace shardcast
