#pragma once
// The paged caches of a model (SPEC §6) and the block tables that address
// them by (request, absolute position).
//
// Caches with the same page geometry form a group that shares one block pool
// and one block table per request; every layer of the group has its own pages
// (PageStore) under the same page ids, as in vLLM's KV-cache groups:
//   swa        every layer's window keys, 64 raw tokens per page
//   c4a        C4A main compressed entries + indexer keys, 64 entries (256 tokens) per page
//   c128a      C128A compressed entries, 2 entries (256 tokens) per page
//   c4a_state  C4A compressor state rows (main + indexer), one 4-token block per page
//   c128a_state C128A compressor state rows, one 128-token block per page
// Capacity is fixed at construction. Reserving pages for a run is all or
// nothing, so running out fails that run alone and touches no other request.
#include <array>
#include <cstdint>
#include <map>
#include <memory>
#include <string_view>
#include <vector>

#include "cache/block_pool.h"
#include "cache/entry_codec.h"
#include "cache/page_store.h"
#include "model/config.h"

namespace dsv4 {

enum class CacheGroup : int { kSwa = 0, kC4A, kC128A, kC4AState, kC128AState };
inline constexpr int kNumCacheGroups = 5;
inline constexpr std::array<CacheGroup, kNumCacheGroups> kAllCacheGroups = {
    CacheGroup::kSwa, CacheGroup::kC4A, CacheGroup::kC128A, CacheGroup::kC4AState, CacheGroup::kC128AState};

std::string_view cache_group_name(CacheGroup g);
int group_entries_per_page(CacheGroup g);
// Raw tokens per entry: 4 or 128 for compressed groups, 1 otherwise.
int group_tokens_per_entry(CacheGroup g);

struct CacheCapacity {
  std::array<int32_t, kNumCacheGroups> pages{};
  int32_t& operator[](CacheGroup g) { return pages[size_t(g)]; }
  int32_t operator[](CacheGroup g) const { return pages[size_t(g)]; }

  // Enough pages for `max_requests` live requests of up to `max_context`
  // tokens each, with steps of up to `max_step_tokens` new tokens.
  static CacheCapacity for_workload(int max_requests, int64_t max_context, int max_step_tokens);
};

struct CacheOptions {
  bool fp8 = true;  // production byte formats; false: float32 entries (exact profile)
  IndexKeyFormat index_keys = IndexKeyFormat::kMxfp4;
  CacheCapacity capacity;
};

// One layer's stores; null where the layer type has no such cache.
struct LayerCaches {
  PageStore* swa = nullptr;
  PageStore* compressed = nullptr;
  PageStore* index_keys = nullptr;
  PageStore* state = nullptr;        // main compressor rows [a | g + ape], 2*k*512 floats
  PageStore* index_state = nullptr;  // indexer compressor rows, 2*2*128 floats
};

class CacheManager {
 public:
  CacheManager(const ModelConfig& config, const CacheOptions& options);

  void open_request(int64_t id);   // throws if it exists
  void close_request(int64_t id);  // frees every page; throws if unknown
  bool has_request(int64_t id) const { return requests_.count(id) != 0; }
  // Tokens the request holds (positions 0 .. length-1 are written).
  int64_t length(int64_t id) const;
  // Context tokens held by all open requests.
  int64_t tokens_held() const;

  // Reserves every page a run [start, start + len) writes, in every group.
  // All or nothing: throws Error naming the exhausted cache and leaves the
  // request as it was.
  void reserve(int64_t id, int64_t start, int len);
  // The request now holds `new_length` tokens: pages no later token reads
  // (SWA pages out of the window, consumed compressor state) go back.
  void commit(int64_t id, int64_t new_length);

  // Global slot of entry `entry` of a group for a request; the page must be reserved.
  int32_t slot(CacheGroup g, int64_t id, int64_t entry) const;
  const std::vector<int32_t>& table(CacheGroup g, int64_t id) const;

  LayerCaches& layer(int l) { return layers_.at(size_t(l)); }
  const LayerCaches& layer(int l) const { return layers_.at(size_t(l)); }
  const BlockPool& pool(CacheGroup g) const { return pools_[size_t(g)]; }
  bool uses(CacheGroup g) const { return pools_[size_t(g)].capacity() > 0; }

  // Bytes of pages in use by the layers of one type (every cache they own).
  size_t bytes_in_use(LayerType t) const;
  // Bytes of pages in use in one group, over all layers.
  size_t bytes_in_use(CacheGroup g) const;

 private:
  struct RequestTables {
    std::array<std::vector<int32_t>, kNumCacheGroups> tables;  // logical block -> page, -1 = none
    int64_t length = 0;
  };
  RequestTables& request(int64_t id);
  const RequestTables& request(int64_t id) const;
  void free_blocks_below(RequestTables& r, CacheGroup g, int64_t end_block);

  const ModelConfig config_;
  std::vector<std::unique_ptr<EntryCodec>> codecs_;
  std::vector<BlockPool> pools_;  // one per group, indexed by CacheGroup
  std::vector<std::unique_ptr<PageStore>> stores_;
  std::vector<std::pair<CacheGroup, const PageStore*>> store_groups_;
  std::vector<LayerCaches> layers_;
  std::map<int64_t, RequestTables> requests_;
};

}  // namespace dsv4
