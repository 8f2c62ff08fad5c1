#pragma once
// The bookkeeping half of the paged caches (SPEC §6): which page holds each
// block of each request, per cache group. No bytes live here; the storage
// (cache/host_storage.h, or device arenas in a GPU backend) holds those under
// the same page ids.
//
// A request's table for a group keeps only its live blocks (first .. first +
// size - 1); what a commit frees is what CacheSpec::first_live_block says no
// later token reads, and a compressor state block that no later token reads
// gets no page in the first place (CacheSpec::needs_page). Reserving the
// pages of a run is all or nothing, so running out (pages or bytes) fails
// that run alone and touches no other request.
#include <array>
#include <cstdint>
#include <map>
#include <span>
#include <string>
#include <vector>

#include "cache/block_pool.h"
#include "cache/cache_spec.h"

namespace dsv4 {

// Upper bounds: page ids per group, and the bytes of all pages in use.
struct CacheLimits {
  std::array<int32_t, kNumCacheGroups> pages{};
  int64_t max_bytes = INT64_MAX;

  int32_t& operator[](CacheGroup g) { return pages[size_t(g)]; }
  int32_t operator[](CacheGroup g) const { return pages[size_t(g)]; }

  // Enough page ids for `max_requests` live requests of up to `max_context`
  // tokens each, with steps of up to `max_step_tokens` new tokens (64-bit
  // arithmetic, clamped so that every global slot fits an int32).
  static CacheLimits for_workload(const CacheSpec& spec, int64_t max_requests, int64_t max_context,
                                  int64_t max_step_tokens);
  // The same workload within `bytes` of cache (a GPU's fixed budget): the
  // bounded groups (SWA window, compressor state) as for_workload says, the
  // compressed groups (which grow with context) get what is left, split so
  // that C4A and C128A pages grow together (both hold 256 tokens a page), up
  // to what the workload can use. Throws Error when even the bounded part
  // does not fit.
  static CacheLimits for_memory(const CacheSpec& spec, int64_t max_requests, int64_t max_context,
                                int64_t max_step_tokens, int64_t bytes);
  // Bytes of every page id these limits allow, with `spec`'s page sizes.
  int64_t bytes(const CacheSpec& spec) const;
  // Raw tokens of compressed history the C4A/C128A pages can hold, over all
  // requests (each page holds 256 tokens); INT64_MAX when no layer compresses.
  int64_t context_tokens(const CacheSpec& spec) const;
};

// A request's live blocks of one group.
struct BlockTableRef {
  int64_t first = 0;                // logical block of pages[0]
  std::span<const int32_t> pages;   // -1 where no page is held
};

class BlockManager {
 public:
  BlockManager(const CacheSpec& spec, const CacheLimits& limits);

  void open_request(int64_t id);   // throws if it exists
  void close_request(int64_t id);  // releases every page; throws if unknown
  bool has_request(int64_t id) const { return requests_.count(id) != 0; }
  int64_t length(int64_t id) const;  // tokens the request holds (positions 0 .. length-1)
  int64_t tokens_held() const;       // over all open requests

  // Gives every block the run [start, start + len) touches a page, in every
  // group, where it needs one (CacheSpec::needs_page). All or nothing: throws
  // CacheExhausted naming the exhausted cache (Error for a bad run) and
  // leaves every table as it was.
  void reserve(int64_t id, int64_t start, int len);
  // The request now holds `new_length` tokens: pages no later token reads go back.
  void commit(int64_t id, int64_t new_length);
  // Why a request of `length` tokens can never be served within the limits,
  // even with the caches to itself and one token a step (the least any
  // schedule holds); empty when it can.
  std::string why_never_fits(int64_t length) const;

  // Global slot of entry `entry` of a group for a request; throws when no page holds it.
  int32_t slot(CacheGroup g, int64_t id, int64_t entry) const;
  BlockTableRef table(CacheGroup g, int64_t id) const;

  const CacheSpec& spec() const { return spec_; }
  const BlockPool& pool(CacheGroup g) const { return pools_[size_t(g)]; }
  bool uses(CacheGroup g) const { return spec_.group(g).used; }
  // Bytes of the pages in use, in one group (all its arenas) and in all.
  int64_t bytes_in_use(CacheGroup g) const;
  int64_t bytes_in_use() const;
  // Bytes of the pages in use in the arenas of one layer type's layers.
  int64_t bytes_in_use(LayerType t) const;
  const CacheLimits& limits() const { return limits_; }

 private:
  struct Table {
    int64_t first = 0;
    std::vector<int32_t> pages;
  };
  struct Request {
    std::array<Table, kNumCacheGroups> tables;
    int64_t length = 0;
  };
  Request& request(int64_t id);
  const Request& request(int64_t id) const;
  void release_below(Table& t, CacheGroup g, int64_t block);

  const CacheSpec& spec_;
  CacheLimits limits_;
  std::vector<BlockPool> pools_;  // one per group
  std::map<int64_t, Request> requests_;
};

}  // namespace dsv4
