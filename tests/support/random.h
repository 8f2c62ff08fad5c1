#pragma once
// Test inputs: n draws of N(0, sd^2) from std::mt19937(seed), in order (the
// same values for the same seed in every test that uses it).
#include <cstddef>
#include <cstdint>
#include <random>
#include <vector>

inline std::vector<float> randn(size_t n, uint32_t seed, float sd = 1.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0, sd);
  std::vector<float> v(n);
  for (float& x : v) x = nd(rng);
  return v;
}
