#pragma once
// Test support for the fused-op suites (fused_test.cu, compressor_test.cu):
// device buffers with guard zones, random bf16/fp32 inputs, comparison with
// the first mismatch spelled out, and the two checks that say where the CPU
// and the GPU may legitimately round differently (see attn/cuda/fused_common.cuh):
//  - rms_tie_risk: rms_norm's float(ss / n) of a row lies so close to a float
//    rounding boundary that another summation order of the double sum of
//    squares could round it the other way (impossible when every order sums
//    exactly, e.g. bf16 rows of moderate range; otherwise about 1e-4 of rows);
//  - rope_tie_risk: a cos/sin of a position lies within 2^-48 (relative) of a
//    float rounding boundary, where glibc's and CUDA's double cos/sin may round
//    differently (about 1e-5 of positions); tests draw positions without it.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "support/cuda_device.h"
#include "numerics/bf16.h"
#include "numerics/rope.h"

namespace dsv4::test::fused {

inline void cuda_ok(cudaError_t e, const std::string& what) {
  if (e != cudaSuccess) throw std::runtime_error(what + ": " + cudaGetErrorString(e));
}

// Every test of these suites skips itself where no CUDA device is present.
class DeviceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!have_cuda_device()) GTEST_SKIP() << "no CUDA device";
  }
};

// ---- device memory with a guard zone -------------------------------------------

inline constexpr uint8_t kGuardByte = 0x5a;
inline constexpr size_t kGuardBytes = 4096;

// `bytes` of device memory followed by kGuardBytes of kGuardByte; the
// payload starts 256-byte aligned (cudaMalloc).
class DeviceBytes {
 public:
  explicit DeviceBytes(size_t bytes) : bytes_(bytes) {
    cuda_ok(cudaMalloc(&ptr_, bytes_ + kGuardBytes), "cudaMalloc of " + std::to_string(bytes_) + " bytes");
    cuda_ok(cudaMemset(ptr_ + bytes_, kGuardByte, kGuardBytes), "cudaMemset guard");
  }
  ~DeviceBytes() { cudaFree(ptr_); }
  DeviceBytes(const DeviceBytes&) = delete;
  DeviceBytes& operator=(const DeviceBytes&) = delete;

  uint8_t* get() const { return ptr_; }
  size_t size() const { return bytes_; }
  void fill(uint8_t byte) { cuda_ok(cudaMemset(ptr_, byte, bytes_), "cudaMemset"); }
  void upload(const void* src, size_t n) {
    cuda_ok(cudaMemcpy(ptr_, src, n, cudaMemcpyHostToDevice), "upload");
  }
  std::vector<uint8_t> download() const {
    std::vector<uint8_t> h(bytes_);
    cuda_ok(cudaMemcpy(h.data(), ptr_, bytes_, cudaMemcpyDeviceToHost), "download");
    return h;
  }
  // Index of the first guard byte that changed, or -1.
  int64_t guard_damage() const {
    std::vector<uint8_t> g(kGuardBytes);
    cuda_ok(cudaMemcpy(g.data(), ptr_ + bytes_, kGuardBytes, cudaMemcpyDeviceToHost), "guard download");
    for (size_t i = 0; i < g.size(); ++i)
      if (g[i] != kGuardByte) return int64_t(i);
    return -1;
  }

 private:
  uint8_t* ptr_ = nullptr;
  size_t bytes_;
};

// A typed array of n elements on the device (with its guard zone).
template <typename T>
class DeviceArray {
 public:
  explicit DeviceArray(size_t n) : n_(n), b_(std::max<size_t>(n, 1) * sizeof(T)) {}
  explicit DeviceArray(const std::vector<T>& h) : DeviceArray(h.size()) { upload(h); }
  T* get() const { return reinterpret_cast<T*>(b_.get()); }
  size_t size() const { return n_; }
  void upload(const std::vector<T>& h) {
    if (h.size() != n_) throw std::runtime_error("DeviceArray::upload: size mismatch");
    if (n_) b_.upload(h.data(), n_ * sizeof(T));
  }
  void fill_bytes(uint8_t byte) { b_.fill(byte); }
  std::vector<T> download() const {
    std::vector<T> h(n_);
    if (n_) cuda_ok(cudaMemcpy(h.data(), b_.get(), n_ * sizeof(T), cudaMemcpyDeviceToHost), "download");
    return h;
  }
  int64_t guard_damage() const { return b_.guard_damage(); }

 private:
  size_t n_;
  DeviceBytes b_;
};

inline void sync_and_check(const std::string& what) {
  cuda_ok(cudaGetLastError(), what + " (launch)");
  cuda_ok(cudaDeviceSynchronize(), what + " (run)");
}

// ---- random inputs -------------------------------------------------------------

// A random bf16 value (as float): random sign, exponent in [lo_exp, hi_exp],
// random 7-bit mantissa. Never zero, never NaN.
inline float random_bf16(std::mt19937_64& rng, int lo_exp, int hi_exp) {
  const uint32_t e = uint32_t(127 + lo_exp + int(rng() % uint64_t(hi_exp - lo_exp + 1)));
  const uint32_t bits = (uint32_t(rng() & 1) << 31) | (e << 23) | (uint32_t(rng() & 0x7f) << 16);
  return std::bit_cast<float>(bits);
}

inline std::vector<uint16_t> random_bf16_bits(std::mt19937_64& rng, size_t n, int lo_exp, int hi_exp) {
  std::vector<uint16_t> v(n);
  for (auto& x : v) x = bf16_bits(random_bf16(rng, lo_exp, hi_exp));
  return v;
}

inline std::vector<float> random_normal(std::mt19937_64& rng, size_t n, float mean, float sd) {
  std::normal_distribution<float> nd(mean, sd);
  std::vector<float> v(n);
  for (auto& x : v) x = nd(rng);
  return v;
}

// Norm weights as a checkpoint holds them: bf16 values near 1.
inline std::vector<float> random_norm_weight(std::mt19937_64& rng, size_t n) {
  std::vector<float> v = random_normal(rng, n, 1.0f, 0.1f);
  for (auto& x : v) x = round_bf16(x);
  return v;
}

inline std::vector<float> bf16_to_floats(const uint16_t* bits, size_t n) {
  std::vector<float> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = bf16_to_float(bits[i]);
  return v;
}

// ---- where the CPU and the GPU may round differently ------------------------------

// See the file comment. Window 2^-38: the tree and sequential double sums of
// up to 16K squares differ by far less than that (relative).
inline bool rms_tie_risk(const float* x, int n) {
  long double total = 0;
  int low = INT_MAX;  // exponent of the lowest set bit over all squares
  for (int i = 0; i < n; ++i) {
    const double d = double(x[i]) * double(x[i]);  // exact
    total += d;
    if (d == 0) continue;
    int e = 0;
    const double m = std::frexp(d, &e);
    const uint64_t mi = uint64_t(std::ldexp(m, 53));
    low = std::min(low, e - 53 + std::countr_zero(mi));
  }
  if (total == 0) return false;
  // Every partial sum is a multiple of 2^low and at most the total: exact in
  // double, whatever the order, when the total is below 2^(low + 53).
  if (total < std::ldexp((long double)1, low + 53)) return false;
  const long double q = total / n, w = std::ldexp((long double)1, -38);
  return float(q * (1 - w)) != float(q * (1 + w));
}

inline bool rope_tie_risk(int64_t pos, const Rope& rope) {
  const double w = std::ldexp(1.0, -48);
  for (float f : rope.inv_freq()) {
    const double angle = double(float(pos) * f);
    for (double v : {std::cos(angle), std::sin(angle)})
      if (float(v * (1 - w)) != float(v * (1 + w))) return true;
  }
  return false;
}

// A position in [lo, hi] without a RoPE tie risk; counts the redraws.
inline int64_t draw_position(std::mt19937_64& rng, int64_t lo, int64_t hi, const Rope& rope, int& redraws) {
  for (int tries = 0; tries < 1000; ++tries) {
    const int64_t p = lo + int64_t(rng() % uint64_t(hi - lo + 1));
    if (!rope_tie_risk(p, rope)) return p;
    ++redraws;
  }
  throw std::runtime_error("no position without a RoPE tie risk in [" + std::to_string(lo) + ", " +
                           std::to_string(hi) + "]");
}

// The largest position <= pos without a RoPE tie risk (the edge of the
// context: 1048575 itself unless it is one of the rare risky ones).
inline int64_t safe_position_at_most(int64_t pos, const Rope& rope, int& redraws) {
  while (rope_tie_risk(pos, rope)) --pos, ++redraws;
  return pos;
}

// The RoPE tables the tests use: a compressed layer's (base 160000 with YaRN)
// and an SWA-only layer's (base 10000).
inline Rope compressed_rope() { return Rope(RopeParams{160000, true, YarnParams{}}); }
inline Rope swa_rope() { return Rope(RopeParams{10000, false, YarnParams{}}); }

// ---- comparisons ---------------------------------------------------------------

// Index of the first differing byte of two equally long ranges, or -1.
inline int64_t first_diff(const uint8_t* a, const uint8_t* b, size_t n) {
  constexpr size_t kChunk = 1 << 16;
  for (size_t off = 0; off < n; off += kChunk) {
    const size_t len = std::min(kChunk, n - off);
    if (std::memcmp(a + off, b + off, len) == 0) continue;
    for (size_t i = off; i < off + len; ++i)
      if (a[i] != b[i]) return int64_t(i);
  }
  return -1;
}

template <typename T>
int64_t first_diff(const std::vector<T>& a, const std::vector<T>& b) {
  if (a.size() != b.size()) return 0;
  const int64_t byte = first_diff(reinterpret_cast<const uint8_t*>(a.data()),
                                  reinterpret_cast<const uint8_t*>(b.data()), a.size() * sizeof(T));
  return byte < 0 ? -1 : byte / int64_t(sizeof(T));
}

inline std::string hex(uint64_t v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "0x%llx", static_cast<unsigned long long>(v));
  return buf;
}

}  // namespace dsv4::test::fused
