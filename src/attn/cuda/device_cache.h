#pragma once
// The bytes of the paged caches on the GPU: one device arena per (layer,
// cache kind) of the CacheSpec, in the byte formats of SPEC §6 (FlashMLA's
// fp8_ds_mla pages), indexed by the block manager's page ids. Arenas are
// allocated once, at the page counts of the engine's cache limits (a GPU
// serves from a fixed budget, decided up front).
#include <array>
#include <cstdint>
#include <vector>

#include "cache/cache_spec.h"
#include "cache/pages.h"

struct CUstream_st;

namespace dsv4::cuda {

class DeviceCache {
 public:
  // `pages[g]`: page ids of group g. Zero-filled.
  DeviceCache(const CacheSpec& spec, const std::array<int32_t, kNumCacheGroups>& pages);
  ~DeviceCache();
  DeviceCache(const DeviceCache&) = delete;
  DeviceCache& operator=(const DeviceCache&) = delete;

  // A layer's arena of one kind; an empty view when the layer has none.
  KvPagesMut pages(int layer, CacheKind k) const;
  int32_t pages(CacheGroup g) const { return pages_[size_t(g)]; }
  int64_t bytes() const { return bytes_; }
  // Every page becomes random valid records (cache/synthetic_fill.h).
  void fill_synthetic(uint64_t seed, CUstream_st* stream);

  // Bytes of one page id over all arenas of a group.
  static int64_t page_bytes(const CacheSpec& spec, CacheGroup g) { return int64_t(spec.group(g).page_bytes); }

 private:
  const CacheSpec& spec_;
  std::array<int32_t, kNumCacheGroups> pages_;
  std::vector<uint8_t*> arenas_;
  int64_t bytes_ = 0;
};

}  // namespace dsv4::cuda
