#include "cache/host_storage.h"

#include "cache/synthetic_fill.h"

namespace dsv4 {

HostCacheStorage::HostCacheStorage(const CacheSpec& spec)
    : spec_(spec), arenas_(spec.arenas().size()), pages_(kNumCacheGroups, 0) {}

void HostCacheStorage::ensure_pages(CacheGroup g, int32_t pages) {
  if (pages <= pages_[size_t(g)]) return;
  for (size_t i = 0; i < arenas_.size(); ++i)
    if (spec_.arenas()[i].group == g) arenas_[i].grow(size_t(pages) * spec_.arenas()[i].page_stride);
  pages_[size_t(g)] = pages;
}

KvPagesMut HostCacheStorage::pages(int layer, CacheKind k) {
  const int i = spec_.arena_index(layer, k);
  if (i < 0) return {};
  const ArenaSpec& a = spec_.arenas()[size_t(i)];
  return KvPagesMut{arenas_[size_t(i)].data(), pages_[size_t(a.group)], spec_.group(a.group).entries_per_page,
                    a.page_stride};
}

KvPages HostCacheStorage::pages(int layer, CacheKind k) const {
  return const_cast<HostCacheStorage*>(this)->pages(layer, k);
}

void HostCacheStorage::fill_synthetic(uint64_t seed) {
  for (size_t i = 0; i < arenas_.size(); ++i) {
    const ArenaSpec& a = spec_.arenas()[i];
    const int epp = spec_.group(a.group).entries_per_page;
    for (size_t off = 0; off < arenas_[i].size(); ++off)
      arenas_[i][off] = synthetic_cache_byte(a.format, epp, seed ^ synthetic_hash(i), int64_t(off / a.page_stride),
                                             off % a.page_stride);
  }
}

int64_t HostCacheStorage::bytes_allocated() const {
  int64_t n = 0;
  for (const auto& a : arenas_) n += int64_t(a.size());
  return n;
}

}  // namespace dsv4
