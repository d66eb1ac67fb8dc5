// tools/cli_util: what the subcommands share: human-readable
// numbers, and one way to turn an Error into a one-line message and an exit code.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "loaders/dtype.h"
#include "loaders/shape.h"

namespace shardcast::tools {

std::string HumanBytes(uint64_t bytes);    // "1.23 GiB"
std::string HumanCount(uint64_t n);        // "229.0 B" (billions), "8.03 M"
// "bf16", "f16", "f32" (or the safetensors names BF16, F16, F32): a dequantization target; throws
// kInvalidArgument naming `origin`.
DType ParseFloatDType(const std::string& text, const std::string& origin);
void WriteTextFile(const std::string& path, const std::string& text);  // throws kIo naming the path

// Makes text from a checkpoint (a key, a path, an error message quoting them) safe to print to a
// terminal: nothing in the result can move the cursor, set a title, clear the screen or reorder
// the line. Printable ASCII and valid UTF-8 pass unchanged; escaped are
//   newline, tab, carriage return          as \n \t \r
//   other C0 controls and DEL              as \xNN     (ESC [ 2 J becomes the visible text \x1b[2J)
//   a backslash                            as \\       (so every escape is unambiguous)
//   C1 controls U+0080-U+009F, and the bidi and line-separator code points U+061C, U+200E-200F,
//   U+2028-202E, U+2066-2069               as \uNNNN
//   bytes that are not valid UTF-8         as \xNN
std::string EscapeForTerminal(std::string_view text);

// Runs body; an Error becomes "shardcast <command>: <message>" on stderr and exit code 2 for bad
// input (checkpoint, config, argument, mismatch) or 1 for everything else.
int RunCommand(const std::string& command, const std::function<int()>& body);

}  // namespace shardcast::tools
