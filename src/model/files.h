#pragma once
// Reading the files a user points at, with messages that say what is wrong
// with a path: missing, a directory, a FIFO (which would block a plain open),
// unreadable.
#include <filesystem>
#include <string>

namespace dsv4 {

// "" for a regular file (symlinks followed); otherwise what the path is:
// "does not exist", "is a directory", "is a FIFO", "is a socket", ...
std::string file_problem(const std::filesystem::path& path);

// Throws Error("<path>: <problem>") unless `path` is a regular file.
void require_regular_file(const std::filesystem::path& path);

// The whole content of a regular file; throws Error naming the path and the
// OS reason when it cannot be read.
std::string read_file_text(const std::filesystem::path& path);

}  // namespace dsv4
