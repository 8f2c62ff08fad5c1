#pragma once
// What the launchers size their grids by: the current device's multiprocessor
// count, read once per device (cudaDeviceGetAttribute is a driver call; the
// launchers ask on every launch).
#include <cuda_runtime.h>

namespace dsv4::cuda {

// The count into *sms; the CUDA error where the runtime could not give it
// (for callers that report errors as codes).
cudaError_t query_sm_count(int* sms);

// The count; throws Error naming the CUDA error.
int device_sm_count();

}  // namespace dsv4::cuda
