#include "model/files.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "common/error.h"

namespace dsv4 {

namespace fs = std::filesystem;

std::string file_problem(const fs::path& path) {
  std::error_code ec;
  const fs::file_status st = fs::status(path, ec);
  switch (st.type()) {
    case fs::file_type::regular: return "";
    case fs::file_type::not_found: return "does not exist";
    case fs::file_type::directory: return "is a directory, not a file";
    case fs::file_type::fifo: return "is a FIFO (named pipe), not a regular file";
    case fs::file_type::socket: return "is a socket, not a regular file";
    case fs::file_type::block: return "is a block device, not a regular file";
    case fs::file_type::character: return "is a character device, not a regular file";
    default: break;
  }
  return ec ? "cannot be examined: " + ec.message() : "is not a regular file";
}

void require_regular_file(const fs::path& path) {
  const std::string problem = file_problem(path);
  DSV4_REQUIRE(problem.empty(), path.string() + ": " + problem);
}

std::string read_file_text(const fs::path& path) {
  // O_NONBLOCK: a FIFO that appeared after the check must not hang the open.
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  DSV4_REQUIRE(fd >= 0, path.string() + ": cannot open: " + std::strerror(errno));
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    const std::string problem = file_problem(path);
    throw Error(path.string() + ": " + (problem.empty() ? "is not a regular file" : problem));
  }
  std::string text;
  char buf[1 << 16];
  while (true) {
    const ssize_t n = ::read(fd, buf, sizeof buf);
    if (n == 0) break;
    if (n < 0) {
      if (errno == EINTR) continue;
      const int err = errno;
      ::close(fd);
      throw Error(path.string() + ": cannot read: " + std::strerror(err));
    }
    text.append(buf, size_t(n));
  }
  ::close(fd);
  return text;
}

}  // namespace dsv4
