#pragma once
// What the GPU benchmarks share: a CUDA check that ends the run, the peaks
// measured on this H200 (the rooflines every row is compared with), a hash for
// synthetic data on host and device, and the graph-replay timer.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <utility>
#include <vector>

#include "common/hash.h"

#define CHECK(expr)                                                                                \
  do {                                                                                             \
    const cudaError_t e_ = (expr);                                                                 \
    if (e_ != cudaSuccess) {                                                                       \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #expr, cudaGetErrorString(e_)); \
      std::exit(1);                                                                                \
    }                                                                                              \
  } while (0)

namespace dsv4::bench {

inline constexpr double kPeakBytes = 4.3e12;   // device-to-device copy, measured
inline constexpr double kPeakFp8 = 1270e12;    // dense FP8 GEMM at 8192^3 (SPEC §8)
inline constexpr double kPeakBf16 = 790e12;    // dense bf16 GEMM, measured

// 32 well-mixed bits of x; constexpr, so device code calls it too.
constexpr uint32_t mix32(uint64_t x) { return uint32_t(mix64(x)); }

// The upper median of v (0 for none).
inline double median(std::vector<double> v) {
  if (v.empty()) return 0.0;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Median microseconds per call. `record(stream)` issues `calls` calls, which
// are captured into one graph so launch gaps do not count; the graph is
// replayed three times to warm up, then `replays` times timed.
template <typename Record>
double graph_median_us(cudaStream_t s, int calls, int replays, Record&& record) {
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
  record(s);
  CHECK(cudaStreamEndCapture(s, &graph));
  CHECK(cudaGraphInstantiate(&exec, graph, 0));
  cudaEvent_t e0, e1;
  CHECK(cudaEventCreate(&e0));
  CHECK(cudaEventCreate(&e1));
  for (int i = 0; i < 3; ++i) CHECK(cudaGraphLaunch(exec, s));
  std::vector<double> us;
  for (int i = 0; i < replays; ++i) {
    CHECK(cudaEventRecord(e0, s));
    CHECK(cudaGraphLaunch(exec, s));
    CHECK(cudaEventRecord(e1, s));
    CHECK(cudaEventSynchronize(e1));
    float ms = 0;
    CHECK(cudaEventElapsedTime(&ms, e0, e1));
    us.push_back(1e3 * ms / calls);
  }
  CHECK(cudaEventDestroy(e0));
  CHECK(cudaEventDestroy(e1));
  CHECK(cudaGraphExecDestroy(exec));
  CHECK(cudaGraphDestroy(graph));
  return median(std::move(us));
}

}  // namespace dsv4::bench
