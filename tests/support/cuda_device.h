#pragma once
// Whether a CUDA device is present: GPU tests skip themselves without one.
#include <cuda_runtime.h>

inline bool have_cuda_device() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}
