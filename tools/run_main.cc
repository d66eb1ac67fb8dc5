#include <c10/util/Flags.h>

#include <CLI/CLI.hpp>
#include <cstdlib>

#include "tools/commands.h"

C10_DECLARE_int(caffe2_log_level);

namespace shardcast::tools {

int RunMain(CLI::App& app, const Runner& run, int argc, char** argv) {
  // c10d logs every closed connection as a warning with a stack trace; our errors already say what
  // happened, once. TORCH_CPP_LOG_LEVEL still wins where a user sets it.
  if (std::getenv("TORCH_CPP_LOG_LEVEL") == nullptr) FLAGS_caffe2_log_level = 2;  // ERROR
  app.require_subcommand(1);
  try {
    app.parse(argc, argv);
  } catch (const CLI::Success& e) {  // --help, --help-all, --version: printed, exit 0
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    app.exit(e);
    return 2;  // usage errors are bad input, like every other
  }
  return run ? run() : 2;
}

}  // namespace shardcast::tools
