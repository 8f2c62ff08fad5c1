// dsv4: the command-line front end. Each subcommand lives in its own file.
// Exit status: 0 success, 1 any error the user can act on (bad arguments,
// files, configs, a FAIL verdict, a run that rejected everything or went
// non-finite), 2 an internal error (a bug).
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <exception>
#include <filesystem>
#include <new>

#include "cli/commands.h"
#include "common/error.h"

namespace {

// Output that never reached its destination (e.g. stdout on a full disk) is
// an error, not a success with a truncated report.
int check_stdout(int status) {
  errno = 0;
  const bool flushed = std::fflush(stdout) == 0;
  if ((flushed && !std::ferror(stdout)) || status != 0) return status;  // one error message is enough
  // A failure of an earlier, implicit flush leaves no errno behind.
  std::fprintf(stderr, "dsv4: error: cannot write standard output: %s\n",
               !flushed && errno ? std::strerror(errno) : "a write failed (disk full? closed pipe?)");
  return 1;
}

}  // namespace

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
    // CLI11 prints the message (none for a FAIL verdict) and returns its own
    // codes (105, 106, ...): any failure is status 1 here.
    return check_stdout(app.exit(e) == 0 ? 0 : 1);
  } catch (const dsv4::Error& e) {
    std::fflush(stdout);  // what was printed before the error comes first
    std::fprintf(stderr, "dsv4: error: %s\n", e.what());
    return check_stdout(1);
  } catch (const std::filesystem::filesystem_error& e) {  // e.g. a directory without permission
    std::fflush(stdout);
    std::fprintf(stderr, "dsv4: error: %s\n", e.what());
    return check_stdout(1);
  } catch (const std::bad_alloc&) {
    std::fflush(stdout);
    std::fprintf(stderr, "dsv4: error: out of memory: the model or the workload does not fit this machine\n");
    return check_stdout(1);
  } catch (const std::exception& e) {
    std::fflush(stdout);
    std::fprintf(stderr, "dsv4: internal error: %s\n", e.what());
    return check_stdout(2);
  }
  return check_stdout(0);
}
