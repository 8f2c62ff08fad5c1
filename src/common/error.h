#pragma once
// One exception type for every user-facing failure: bad config, bad checkpoint,
// bad request, exhausted cache. The message names what is wrong.
#include <stdexcept>
#include <string>

namespace dsv4 {

struct Error : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// Throws Error(message) when cond is false.
inline void require(bool cond, const std::string& message) {
  if (!cond) throw Error(message);
}

}  // namespace dsv4
