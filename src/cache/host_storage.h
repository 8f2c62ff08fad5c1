#pragma once
// The bytes half of the paged caches on the host: one arena per (layer, cache
// kind) of the CacheSpec, indexed by the block manager's page ids. Arenas grow
// on demand to the pool's high-water mark, so memory follows what requests
// hold rather than the limits the engine was configured with.
#include <cstdint>
#include <vector>

#include "cache/cache_spec.h"
#include "cache/host_arena.h"
#include "cache/pages.h"

namespace dsv4 {

class HostCacheStorage {
 public:
  explicit HostCacheStorage(const CacheSpec& spec);

  // Every arena of group g holds pages [0, pages) afterwards (new bytes zeroed).
  // Views taken before a call that grows an arena are invalid after it.
  void ensure_pages(CacheGroup g, int32_t pages);
  // A layer's arena of one kind; an empty view when the layer has none.
  KvPagesMut pages(int layer, CacheKind k);
  KvPages pages(int layer, CacheKind k) const;
  int64_t bytes_allocated() const;
  // Every allocated page becomes random valid records (cache/synthetic_fill.h).
  void fill_synthetic(uint64_t seed);

 private:
  const CacheSpec& spec_;
  std::vector<HostArena> arenas_;  // one per spec.arenas()
  std::vector<int32_t> pages_;     // pages held, per group
};

}  // namespace dsv4
