#pragma once
// One exception type for every user-facing failure: bad config, bad checkpoint,
// bad request, exhausted cache. The message names what is wrong.
#include <stdexcept>
#include <string>

namespace dsv4 {

struct Error : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// The caches cannot hold what a run needs now; they may once other requests
// let their pages go (the scheduler then retries or preempts).
struct CacheExhausted : Error {
  using Error::Error;
};

}  // namespace dsv4

// Throws dsv4::Error(message) when cond is false. A macro so that the message
// (often built from numbers) is only built on failure: checks sit on hot paths.
#define DSV4_REQUIRE(cond, message)                   \
  do {                                                \
    if (!(cond)) throw ::dsv4::Error(message);        \
  } while (false)
