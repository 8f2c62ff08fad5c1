#include "attn/cuda/device_cache.h"

#include <cuda_runtime.h>

#include <string>

#include "cache/synthetic_fill.h"
#include "common/error.h"

namespace dsv4::cuda {

DeviceCache::DeviceCache(const CacheSpec& spec, const std::array<int32_t, kNumCacheGroups>& pages)
    : spec_(spec), pages_(pages) {
  arenas_.assign(spec.arenas().size(), nullptr);
  try {
    for (size_t i = 0; i < arenas_.size(); ++i) {
      const ArenaSpec& a = spec.arenas()[i];
      const size_t bytes = size_t(pages_[size_t(a.group)]) * a.page_stride;
      if (bytes == 0) continue;
      const cudaError_t e = cudaMalloc(&arenas_[i], bytes);
      if (e != cudaSuccess)
        throw Error("device cache: cannot allocate " + std::to_string(bytes) + " bytes for layer " +
                    std::to_string(a.layer) + "'s " + std::string(cache_kind_name(a.kind)) + " cache (" +
                    std::to_string(bytes_) + " allocated so far): " + cudaGetErrorString(e));
      // Zeros, so that no kernel ever reads uninitialised memory (initcheck),
      // whatever a bug might read.
      if (cudaMemset(arenas_[i], 0, bytes) != cudaSuccess) throw Error("device cache: cudaMemset failed");
      bytes_ += int64_t(bytes);
    }
  } catch (...) {
    for (uint8_t* p : arenas_) cudaFree(p);
    throw;
  }
}

namespace {

// Four bytes per thread, grid-stride over the arena.
__global__ void fill_kernel(uint8_t* base, int64_t bytes, size_t stride, int epp, EntryFormat f, uint64_t seed) {
  for (int64_t i = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) * 4; i < bytes; i += int64_t(gridDim.x) * blockDim.x * 4) {
    uint32_t w = 0;
    for (int k = 0; k < 4 && i + k < bytes; ++k) {
      const int64_t off = i + k;
      w |= uint32_t(synthetic_cache_byte(f, epp, seed, off / int64_t(stride), size_t(off) % stride)) << (8 * k);
    }
    if (i + 4 <= bytes) *reinterpret_cast<uint32_t*>(base + i) = w;
    else
      for (int k = 0; i + k < bytes; ++k) base[i + k] = uint8_t(w >> (8 * k));
  }
}

}  // namespace

void DeviceCache::fill_synthetic(uint64_t seed, CUstream_st* stream) {
  for (size_t i = 0; i < arenas_.size(); ++i) {
    if (!arenas_[i]) continue;
    const ArenaSpec& a = spec_.arenas()[i];
    const int64_t bytes = int64_t(pages_[size_t(a.group)]) * int64_t(a.page_stride);
    fill_kernel<<<1024, 256, 0, stream>>>(arenas_[i], bytes, a.page_stride, spec_.group(a.group).entries_per_page,
                                          a.format, seed ^ synthetic_hash(i));
    if (cudaGetLastError() != cudaSuccess) throw Error("device cache: fill kernel launch failed");
  }
}

DeviceCache::~DeviceCache() {
  for (uint8_t* p : arenas_) cudaFree(p);
}

KvPagesMut DeviceCache::pages(int layer, CacheKind k) const {
  const int i = spec_.arena_index(layer, k);
  if (i < 0 || arenas_[size_t(i)] == nullptr) return {};
  const ArenaSpec& a = spec_.arenas()[size_t(i)];
  return KvPagesMut{arenas_[size_t(i)], pages_[size_t(a.group)], spec_.group(a.group).entries_per_page, a.page_stride};
}

}  // namespace dsv4::cuda
