#pragma once
// The message of the dsv4::Error a callable throws; fails the test when it throws none.
#include <gtest/gtest.h>

#include <functional>
#include <string>

#include "common/error.h"

// The message `msg` contains `needle` (shown in full when not).
#define EXPECT_MENTIONS(msg, needle) EXPECT_NE((msg).find(needle), std::string::npos) << (msg)

namespace dsv4::test {

inline std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  ADD_FAILURE() << "no dsv4::Error thrown";
  return "";
}

}  // namespace dsv4::test
