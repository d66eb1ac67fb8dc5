#include "tools/cli_util.h"

#include <gtest/gtest.h>

#include <string>

namespace shardcast::tools {
namespace {

TEST(EscapeForTerminal, PassesPrintableAsciiAndValidUtf8Unchanged) {
  EXPECT_EQ(EscapeForTerminal("model.layers.0.self_attn.q_proj.weight"), "model.layers.0.self_attn.q_proj.weight");
  EXPECT_EQ(EscapeForTerminal("caf\xc3\xa9 \xe6\xa8\xa1\xe5\x9e\x8b \xf0\x9f\x98\x80"),
            "caf\xc3\xa9 \xe6\xa8\xa1\xe5\x9e\x8b \xf0\x9f\x98\x80");
  EXPECT_EQ(EscapeForTerminal(""), "");
}

TEST(EscapeForTerminal, EscapesC0DelAndTheBackslash) {
  EXPECT_EQ(EscapeForTerminal("a\nb\tc\rd"), "a\\nb\\tc\\rd");
  EXPECT_EQ(EscapeForTerminal("\x1b[2J\x1b]0;title\x07"), "\\x1b[2J\\x1b]0;title\\x07");
  EXPECT_EQ(EscapeForTerminal(std::string("a\0b", 3)), "a\\x00b");
  EXPECT_EQ(EscapeForTerminal("\x7f"), "\\x7f");
  EXPECT_EQ(EscapeForTerminal("C:\\x1b"), "C:\\\\x1b");  // a literal backslash cannot fake an escape
}

TEST(EscapeForTerminal, EscapesC1BidiAndLineSeparators) {
  EXPECT_EQ(EscapeForTerminal("\xc2\x9b" "31m"), "\\u009b31m");  // CSI as a code point
  EXPECT_EQ(EscapeForTerminal("\xc2\x80\xc2\x9f\xc2\xa0"), "\\u0080\\u009f\xc2\xa0");  // NBSP is fine
  EXPECT_EQ(EscapeForTerminal("abc\xe2\x80\xae" "fdp.exe"), "abc\\u202efdp.exe");  // RIGHT-TO-LEFT OVERRIDE
  EXPECT_EQ(EscapeForTerminal("\xe2\x80\xa8\xe2\x81\xa6\xd8\x9c"), "\\u2028\\u2066\\u061c");
}

TEST(EscapeForTerminal, EscapesEveryByteThatIsNotUtf8) {
  EXPECT_EQ(EscapeForTerminal("ckpt-\xff\xfe"), "ckpt-\\xff\\xfe");
  EXPECT_EQ(EscapeForTerminal("\x9b" "31m"), "\\x9b31m");               // a raw C1 byte (CSI in 8-bit terminals)
  EXPECT_EQ(EscapeForTerminal("\xc0\x80"), "\\xc0\\x80");                // overlong NUL
  EXPECT_EQ(EscapeForTerminal("\xed\xa0\x80"), "\\xed\\xa0\\x80");       // a surrogate
  EXPECT_EQ(EscapeForTerminal("\xe6\xa8"), "\\xe6\\xa8");                // truncated at the end
  EXPECT_EQ(EscapeForTerminal("\xe6\xa8" "x"), "\\xe6\\xa8x");
}

TEST(EscapeForTerminal, OutputHasNoControlBytesForAnyInput) {
  std::string all;
  for (int i = 0; i < 256; ++i) all += static_cast<char>(i);
  for (const std::string& s : {all, all + all.substr(0xc2), std::string("\xc2") + all}) {
    for (unsigned char c : EscapeForTerminal(s)) {
      EXPECT_FALSE(c < 0x20 || c == 0x7f) << static_cast<int>(c);
    }
  }
}

}  // namespace
}  // namespace shardcast::tools
