#pragma once
// The splitmix64 generator, one implementation for every synthetic draw
// (weights, workload inputs, cache fills) on host and device: counter-based,
// so element i of a tensor is the same however the work is split.
#include <cstdint>

namespace dsv4 {

inline constexpr uint64_t kGoldenGamma = 0x9e3779b97f4a7c15ull;

// The finalizer: a well-mixed 64-bit function of z.
constexpr uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// The sequential generator: advances the state, returns the next value.
constexpr uint64_t splitmix64(uint64_t& state) { return mix64(state += kGoldenGamma); }

}  // namespace dsv4
