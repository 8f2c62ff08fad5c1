#include "cache/block_manager.h"

#include <algorithm>
#include <string>

#include "common/error.h"

namespace dsv4 {

CacheLimits CacheLimits::for_workload(const CacheSpec& spec, int64_t max_requests, int64_t max_context,
                                      int64_t max_step_tokens) {
  DSV4_REQUIRE(max_requests >= 0 && max_context >= 0 && max_step_tokens >= 0, "cache limits: negative workload size");
  auto ceil_div = [](int64_t a, int64_t b) { return (a + b - 1) / b; };
  // Saturating a * b + c: the limits only need to be large enough.
  auto mad = [](int64_t a, int64_t b, int64_t c) {
    return b != 0 && a > (INT64_MAX / 2) / b ? INT64_MAX / 2 : std::min(a * b + c, INT64_MAX / 2);
  };
  // Per group: what each live request keeps (window pages, compressed
  // history, the state blocks a slot pools) plus what one step's new tokens
  // add over all its runs. State: a request keeps at most 2 C4A blocks and 1
  // C128A block between steps, and a run gets pages only for the blocks it
  // leaves live (CacheSpec::needs_page): at most 2 C4A blocks, and at most
  // one a 4 tokens it brings (so r + step/4 over all runs), and 1 C128A block.
  const int64_t r = max_requests, step = max_step_tokens;
  const std::array<int64_t, kNumCacheGroups> want = {
      mad(r, 4, ceil_div(step, 64)),                                    // swa
      mad(r, ceil_div(max_context, 256) + 1, 0),                        // c4a: one page per 256 tokens
      mad(r, ceil_div(max_context, 256) + 1, 0),                        // c128a
      mad(r, 2, std::min(mad(r, 2, 0), mad(r, 1, ceil_div(step, 4)))),  // c4a_state
      mad(r, 2, 0)};                                                    // c128a_state
  CacheLimits l;
  for (CacheGroup g : kAllCacheGroups) {
    if (!spec.group(g).used) continue;
    // Global slots are int32: pages * entries_per_page must stay below 2^31.
    const int64_t max_pages = (int64_t(INT32_MAX) - 1) / spec.group(g).entries_per_page;
    l[g] = int32_t(std::min(want[size_t(g)], max_pages));
  }
  return l;
}

CacheLimits CacheLimits::for_memory(const CacheSpec& spec, int64_t max_requests, int64_t max_context,
                                    int64_t max_step_tokens, int64_t bytes) {
  CacheLimits l = for_workload(spec, max_requests, max_context, max_step_tokens);
  int64_t fixed = 0, per_page = 0;
  for (CacheGroup g : kAllCacheGroups) {
    const int64_t pb = int64_t(spec.group(g).page_bytes);
    if (group_grows_with_context(g)) per_page += spec.group(g).used ? pb : 0;
    else fixed += int64_t(l[g]) * pb;
  }
  // Room for the fixed part and at least one page of each growing group.
  DSV4_REQUIRE(fixed + per_page <= bytes,
               "cache: " + std::to_string(bytes) + " bytes cannot hold the SWA windows and compressor state of " +
                   std::to_string(max_requests) + " requests (" + std::to_string(fixed) + " bytes) and a page of " +
                   "compressed entries (" + std::to_string(per_page) + " bytes); give the caches more memory or "
                   "lower the number of requests or the step's tokens");
  l.max_bytes = bytes;
  if (per_page == 0) return l;
  const int64_t pages = (bytes - fixed) / per_page;
  for (CacheGroup g : kAllCacheGroups)
    if (group_grows_with_context(g) && spec.group(g).used) l[g] = int32_t(std::min<int64_t>(l[g], pages));
  return l;
}

int64_t CacheLimits::bytes(const CacheSpec& spec) const {
  int64_t n = 0;
  for (CacheGroup g : kAllCacheGroups) n += int64_t((*this)[g]) * int64_t(spec.group(g).page_bytes);
  return n;
}

int64_t CacheLimits::context_tokens(const CacheSpec& spec) const {
  int64_t tokens = INT64_MAX;
  for (CacheGroup g : {CacheGroup::kC4A, CacheGroup::kC128A})
    if (spec.group(g).used) tokens = std::min<int64_t>(tokens, int64_t((*this)[g]) * 256);
  return tokens;
}

BlockManager::BlockManager(const CacheSpec& spec, const CacheLimits& limits) : spec_(spec), limits_(limits) {
  DSV4_REQUIRE(limits.max_bytes > 0, "cache: the memory limit must be positive");
  for (CacheGroup g : kAllCacheGroups) {
    const int32_t pages = uses(g) ? limits[g] : 0;
    DSV4_REQUIRE(!uses(g) || pages > 0, "cache '" + std::string(cache_group_name(g)) + "' needs a positive capacity");
    DSV4_REQUIRE(int64_t(pages) * spec.group(g).entries_per_page <= INT32_MAX,
            "cache '" + std::string(cache_group_name(g)) + "': too many pages for 32-bit slots");
    pools_.emplace_back(pages);
  }
}

void BlockManager::open_request(int64_t id) {
  DSV4_REQUIRE(!has_request(id), "request " + std::to_string(id) + " is already open");
  requests_[id];
}

void BlockManager::close_request(int64_t id) {
  Request& r = request(id);
  for (CacheGroup g : kAllCacheGroups)
    for (int32_t page : r.tables[size_t(g)].pages)
      if (page >= 0) pools_[size_t(g)].release(page);
  requests_.erase(id);
}

BlockManager::Request& BlockManager::request(int64_t id) {
  auto it = requests_.find(id);
  if (it == requests_.end()) throw Error("unknown request " + std::to_string(id));
  return it->second;
}

const BlockManager::Request& BlockManager::request(int64_t id) const {
  auto it = requests_.find(id);
  if (it == requests_.end()) throw Error("unknown request " + std::to_string(id));
  return it->second;
}

int64_t BlockManager::length(int64_t id) const { return request(id).length; }

int64_t BlockManager::tokens_held() const {
  int64_t n = 0;
  for (const auto& [id, r] : requests_) n += r.length;
  return n;
}

namespace {

// The blocks of `want` (none below t.first) that `t` holds no page for, in
// order: its holes among the blocks it covers, then every block past its end.
// A decode token touches the whole compressed history (256 blocks a group at
// 64K context), whose table has no holes: one branch-free pass finds that.
void missing_blocks(const auto& t, const BlockRange& want, std::vector<int64_t>& out) {
  if (want.empty()) return;
  const int64_t end = t.pages.empty() ? want.first : t.first + int64_t(t.pages.size());
  const int64_t covered = std::max<int64_t>(0, std::min(want.last + 1, end) - want.first);
  if (covered > 0) {
    const int32_t* p = t.pages.data() + (want.first - t.first);
    int32_t any = 0;
    for (int64_t i = 0; i < covered; ++i) any |= p[i];  // -1 marks a hole
    if (any < 0)
      for (int64_t i = 0; i < covered; ++i)
        if (p[i] < 0) out.push_back(want.first + i);
  }
  for (int64_t b = want.first + covered; b <= want.last; ++b) out.push_back(b);
}

}  // namespace

void BlockManager::reserve(int64_t id, int64_t start, int len) {
  Request& r = request(id);
  std::array<std::vector<int64_t>, kNumCacheGroups> missing;
  int64_t new_bytes = 0;
  for (CacheGroup g : kAllCacheGroups) {
    if (!uses(g)) continue;
    BlockRange want = spec_.blocks_touched(g, start, len);
    while (!want.empty() && !spec_.needs_page(g, want.first, start, len)) ++want.first;
    const Table& t = r.tables[size_t(g)];
    if (!want.empty() && !t.pages.empty() && want.first < t.first)
      throw Error("request " + std::to_string(id) + ": block " + std::to_string(want.first) + " of cache '" +
                  std::string(cache_group_name(g)) + "' was already freed");
    std::vector<int64_t>& need_pages = missing[size_t(g)];
    missing_blocks(t, want, need_pages);
    std::erase_if(need_pages, [&](int64_t b) { return !spec_.needs_page(g, b, start, len); });
    const BlockPool& pool = pools_[size_t(g)];
    const size_t need = need_pages.size();
    if (int64_t(need) > pool.free_count())
      throw CacheExhausted("request " + std::to_string(id) + ": cache '" + std::string(cache_group_name(g)) +
                           "' is exhausted: positions " + std::to_string(start) + ".." +
                           std::to_string(start + len - 1) + " need " + std::to_string(need) + " more pages, " +
                           std::to_string(pool.free_count()) + " of " + std::to_string(pool.capacity()) + " are free");
    new_bytes += int64_t(need) * int64_t(spec_.group(g).page_bytes);
  }
  if (bytes_in_use() + new_bytes > limits_.max_bytes)
    throw CacheExhausted("request " + std::to_string(id) + ": positions " + std::to_string(start) + ".." +
                         std::to_string(start + len - 1) + " need " + std::to_string(new_bytes) +
                         " more bytes of cache; " + std::to_string(bytes_in_use()) + " of the limit of " +
                         std::to_string(limits_.max_bytes) + " are in use");
  for (CacheGroup g : kAllCacheGroups) {
    Table& t = r.tables[size_t(g)];
    for (int64_t b : missing[size_t(g)]) {
      if (t.pages.empty()) t.first = b;
      t.pages.resize(size_t(std::max<int64_t>(int64_t(t.pages.size()), b - t.first + 1)), -1);
      t.pages[size_t(b - t.first)] = pools_[size_t(g)].allocate();
    }
  }
}

std::string BlockManager::why_never_fits(int64_t length) const {
  // A one-token run at position p holds blocks first_live_block(p) .. the
  // last it touches. The bounded groups repeat every 64 positions from 128
  // on (and hold no more before) and the compressed groups only grow, so the
  // most any position holds is held within the last 256.
  const std::string tail = " (one token a step, the caches to itself): it cannot fit";
  for (int64_t p = std::max<int64_t>(0, length - 256); p < length; ++p) {
    int64_t bytes = 0;
    for (CacheGroup g : kAllCacheGroups) {
      if (!uses(g)) continue;
      const BlockRange r = spec_.blocks_touched(g, p, 1);
      const int64_t pages = r.empty() ? 0 : r.last - spec_.first_live_block(g, p) + 1;
      if (pages > pool(g).capacity())
        return "position " + std::to_string(p) + " needs " + std::to_string(pages) + " pages of cache '" +
               std::string(cache_group_name(g)) + "', which has " + std::to_string(pool(g).capacity()) + tail;
      bytes += pages * int64_t(spec_.group(g).page_bytes);
    }
    if (bytes > limits_.max_bytes)
      return "position " + std::to_string(p) + " needs " + std::to_string(bytes) +
             " bytes of cache, beyond the limit of " + std::to_string(limits_.max_bytes) + tail;
  }
  return {};
}

void BlockManager::release_below(Table& t, CacheGroup g, int64_t block) {
  const int64_t drop = std::min<int64_t>(std::max<int64_t>(0, block - t.first), int64_t(t.pages.size()));
  for (int64_t i = 0; i < drop; ++i)
    if (t.pages[size_t(i)] >= 0) pools_[size_t(g)].release(t.pages[size_t(i)]);
  t.pages.erase(t.pages.begin(), t.pages.begin() + drop);
  t.first += drop;
}

void BlockManager::commit(int64_t id, int64_t new_length) {
  Request& r = request(id);
  DSV4_REQUIRE(new_length >= r.length, "request " + std::to_string(id) + ": length cannot shrink");
  r.length = new_length;
  for (CacheGroup g : kAllCacheGroups)
    release_below(r.tables[size_t(g)], g, spec_.first_live_block(g, new_length));
}

int32_t BlockManager::slot(CacheGroup g, int64_t id, int64_t entry) const {
  const Table& t = request(id).tables[size_t(g)];
  const int b = spec_.group(g).entries_per_page;
  const int64_t col = entry < 0 ? -1 : entry / b - t.first;
  if (col < 0 || col >= int64_t(t.pages.size()) || t.pages[size_t(col)] < 0)
    throw Error("request " + std::to_string(id) + ": entry " + std::to_string(entry) + " of cache '" +
                std::string(cache_group_name(g)) + "' has no page");
  return int32_t(int64_t(t.pages[size_t(col)]) * b + entry % b);
}

BlockTableRef BlockManager::table(CacheGroup g, int64_t id) const {
  const Table& t = request(id).tables[size_t(g)];
  return BlockTableRef{t.first, std::span<const int32_t>(t.pages)};
}

int64_t BlockManager::bytes_in_use(CacheGroup g) const {
  return int64_t(pools_[size_t(g)].used_count()) * int64_t(spec_.group(g).page_bytes);
}

int64_t BlockManager::bytes_in_use(LayerType t) const {
  int64_t n = 0;
  for (const ArenaSpec& a : spec_.arenas())
    if (a.layer_type == t) n += int64_t(pools_[size_t(a.group)].used_count()) * int64_t(a.page_stride);
  return n;
}

int64_t BlockManager::bytes_in_use() const {
  int64_t n = 0;
  for (CacheGroup g : kAllCacheGroups) n += bytes_in_use(g);
  return n;
}

}  // namespace dsv4
