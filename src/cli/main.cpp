// dsv4: the command-line front end. Each subcommand lives in its own file.
#include <cstdio>
#include <exception>

#include "cli/commands.h"
#include "common/error.h"

int main(int argc, char** argv) {
  dsv4::cli::reexec_with_runtime_env(argv);
  CLI::App app{"dsv4: DeepSeek-V4 hybrid sparse attention (SWA + C4A + C128A)"};
  app.require_subcommand(1);
  dsv4::cli::register_inspect(app);
  dsv4::cli::register_verify(app);
  dsv4::cli::register_run(app);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  } catch (const dsv4::Error& e) {
    std::fprintf(stderr, "dsv4: error: %s\n", e.what());
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "dsv4: internal error: %s\n", e.what());
    return 2;
  }
  return 0;
}
