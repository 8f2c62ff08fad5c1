#include "attn/cuda/device_cache.h"

#include <cuda_runtime.h>

#include <string>

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
