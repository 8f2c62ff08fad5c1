#pragma once
// Times two pieces of work in turn, `reps` times each, and keeps each one's
// fastest run. The tests that check a parser's time grows linearly compare
// the two: timed in turn, a busy spell of the machine (ctest -j2, a build
// beside it) slows both or neither, where timed one after the other it once
// slowed only the large one (26.7x against a bound of 24x).
#include <algorithm>
#include <chrono>
#include <utility>

namespace dsv4::test {

template <class A, class B>
std::pair<double, double> fastest_in_turn(A&& a, B&& b, int reps = 5) {
  const auto seconds = [](auto&& f) {
    const auto t0 = std::chrono::steady_clock::now();
    f();
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  };
  std::pair<double, double> best{1e9, 1e9};
  for (int rep = 0; rep < reps; ++rep) {
    best.first = std::min(best.first, seconds(a));
    best.second = std::min(best.second, seconds(b));
  }
  return best;
}

}  // namespace dsv4::test
