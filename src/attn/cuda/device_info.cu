#include "attn/cuda/device_info.h"

#include <atomic>
#include <string>

#include "common/error.h"

namespace dsv4::cuda {

cudaError_t query_sm_count(int* sms) {
  constexpr int kCachedDevices = 64;
  static std::atomic<int> cache[kCachedDevices] = {};  // 0: not read yet
  int dev = 0;
  cudaError_t e = cudaGetDevice(&dev);
  if (e != cudaSuccess) return e;
  if (dev >= 0 && dev < kCachedDevices && (*sms = cache[dev].load(std::memory_order_relaxed)) > 0) return cudaSuccess;
  if ((e = cudaDeviceGetAttribute(sms, cudaDevAttrMultiProcessorCount, dev)) != cudaSuccess) return e;
  if (dev >= 0 && dev < kCachedDevices) cache[dev].store(*sms, std::memory_order_relaxed);
  return cudaSuccess;
}

int device_sm_count() {
  int sms = 0;
  const cudaError_t e = query_sm_count(&sms);
  if (e != cudaSuccess) throw Error(std::string("CUDA device's multiprocessor count: ") + cudaGetErrorString(e));
  return sms;
}

}  // namespace dsv4::cuda
