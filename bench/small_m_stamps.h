#pragma once
// --stamps in linear_bench and step_bench: the small-M kernel's per-CTA timer
// stamps (set_small_m_stamps in attn/cuda/linear.h: wo_a's products of up to
// 8 rows) and what they say about the last launch that wrote them.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <iterator>
#include <vector>

#include "attn/cuda/linear.h"

namespace dsv4::bench {

class SmallMStamps {
 public:
  // Stamped launches are those of two CTAs an SM (larger grids take the
  // unstamped three-CTA variant), so at most 264 CTAs on an H200; room for more.
  static constexpr int kMaxCtas = 4096;

  SmallMStamps() { check(cudaMalloc(&buf_, bytes()), "cudaMalloc"); }
  ~SmallMStamps() {
    cuda::set_small_m_stamps(nullptr);
    cudaFree(buf_);
  }
  SmallMStamps(const SmallMStamps&) = delete;
  SmallMStamps& operator=(const SmallMStamps&) = delete;

  // Zeroes the buffer and turns the stamps on (launches and graph captures from now on write them).
  void on() {
    check(cudaMemset(buf_, 0, bytes()), "cudaMemset");
    cuda::set_small_m_stamps(buf_);
  }
  void off() { cuda::set_small_m_stamps(nullptr); }

  // Prints the launch whose stamps the buffer holds: when its CTAs passed each
  // point, in µs from the earliest return of the programmatic-launch wait (the
  // moment the previous kernel's results were visible), and each phase's
  // length per CTA.
  void print(const char* label) const {
    check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
    std::vector<unsigned long long> h(size_t(kMaxCtas) * cuda::kSmallMStampCount);
    check(cudaMemcpy(h.data(), buf_, bytes(), cudaMemcpyDeviceToHost), "cudaMemcpy");
    auto at = [&](int cta, int point) { return h[size_t(cta) * cuda::kSmallMStampCount + point]; };
    int ctas = 0;
    while (ctas < kMaxCtas && at(ctas, cuda::kStampWritten) != 0) ++ctas;
    if (ctas == 0) {
      std::printf("%s: no small-M launch wrote stamps\n", label);
      return;
    }
    unsigned long long t0 = ~0ull;
    for (int c = 0; c < ctas; ++c) t0 = std::min(t0, at(c, cuda::kStampWaited));
    int late = 0;
    for (int c = 0; c < ctas; ++c) late += at(c, cuda::kStampEntry) > t0;
    std::printf("%s: %d CTAs, %d of them resident only after the first wait returned\n", label, ctas, late);
    constexpr const char* points[] = {"entry", "waited", "staged", "looped", "summed", "written"};
    static_assert(std::size(points) == cuda::kSmallMStampCount, "a name for every SmallMStamp");
    std::printf("| point | first us | median us | last us |\n|---|---|---|---|\n");
    for (int p = 0; p < cuda::kSmallMStampCount; ++p) {
      std::vector<double> v;
      for (int c = 0; c < ctas; ++c) v.push_back((double(at(c, p)) - double(t0)) * 1e-3);
      print_row(points[p], v);
    }
    constexpr const char* phases[] = {"entry to waited", "staging", "weight loop", "split sum", "outputs"};
    static_assert(std::size(phases) + 1 == cuda::kSmallMStampCount, "a name for every pair of stamps");
    std::printf("| phase of a CTA | shortest us | median us | longest us |\n|---|---|---|---|\n");
    for (int p = 0; p + 1 < cuda::kSmallMStampCount; ++p) {
      std::vector<double> v;
      for (int c = 0; c < ctas; ++c) v.push_back(double(at(c, p + 1) - at(c, p)) * 1e-3);
      print_row(phases[p], v);
    }
    std::fflush(stdout);
  }

 private:
  static size_t bytes() { return size_t(kMaxCtas) * cuda::kSmallMStampCount * sizeof(unsigned long long); }
  static void check(cudaError_t e, const char* what) {
    if (e != cudaSuccess) {
      std::fprintf(stderr, "small-M stamps: %s: %s\n", what, cudaGetErrorString(e));
      std::exit(1);
    }
  }
  static void print_row(const char* name, std::vector<double> v) {
    std::sort(v.begin(), v.end());
    std::printf("| %s | %.2f | %.2f | %.2f |\n", name, v.front(), v[v.size() / 2], v.back());
  }

  unsigned long long* buf_ = nullptr;
};

}  // namespace dsv4::bench
