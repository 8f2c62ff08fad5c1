#include "cache/cache_manager.h"

#include <algorithm>
#include <string>

#include "cache/fp8_ds_mla.h"
#include "common/error.h"

namespace dsv4 {

std::string_view cache_group_name(CacheGroup g) {
  switch (g) {
    case CacheGroup::kSwa: return "swa";
    case CacheGroup::kC4A: return "c4a";
    case CacheGroup::kC128A: return "c128a";
    case CacheGroup::kC4AState: return "c4a_state";
    case CacheGroup::kC128AState: return "c128a_state";
  }
  return "?";
}

int group_entries_per_page(CacheGroup g) {
  switch (g) {
    case CacheGroup::kSwa: return 64;
    case CacheGroup::kC4A: return 64;
    case CacheGroup::kC128A: return 2;
    case CacheGroup::kC4AState: return 4;
    case CacheGroup::kC128AState: return 128;
  }
  return 1;
}

int group_tokens_per_entry(CacheGroup g) {
  return g == CacheGroup::kC4A ? 4 : g == CacheGroup::kC128A ? 128 : 1;
}

CacheCapacity CacheCapacity::for_workload(int max_requests, int64_t max_context, int max_step_tokens) {
  auto ceil_div = [](int64_t a, int64_t b) { return int32_t((a + b - 1) / b); };
  const int32_t r = max_requests;
  CacheCapacity c;
  c[CacheGroup::kSwa] = r * 4 + ceil_div(max_step_tokens, 64);
  c[CacheGroup::kC4A] = r * (ceil_div(max_context, 256) + 1);
  c[CacheGroup::kC128A] = r * (ceil_div(max_context, 256) + 1);
  c[CacheGroup::kC4AState] = r * 3 + ceil_div(max_step_tokens, 4);
  c[CacheGroup::kC128AState] = r * 3 + ceil_div(max_step_tokens, 128);
  return c;
}

CacheManager::CacheManager(const ModelConfig& config, const CacheOptions& options) : config_(config) {
  const bool has_c4a = config.count_layers(LayerType::kC4A) > 0;
  const bool has_c128a = config.count_layers(LayerType::kC128A) > 0;
  const bool used[kNumCacheGroups] = {true, has_c4a, has_c128a, has_c4a, has_c128a};
  for (CacheGroup g : kAllCacheGroups) {
    const int32_t pages = used[int(g)] ? options.capacity[g] : 0;
    require(!used[int(g)] || pages > 0, "cache '" + std::string(cache_group_name(g)) + "' needs a positive capacity");
    pools_.emplace_back(pages);
  }
  const EntryCodec* kv = codecs_.emplace_back(options.fp8 ? make_fp8_ds_mla_codec() : make_f32_codec(kKvDim)).get();
  const EntryCodec* keys =
      codecs_.emplace_back(options.fp8 ? make_index_key_codec(options.index_keys) : make_f32_codec(kIndexDim)).get();
  const EntryCodec* c4a_rows = codecs_.emplace_back(make_f32_codec(2 * 2 * kKvDim)).get();
  const EntryCodec* c4a_index_rows = codecs_.emplace_back(make_f32_codec(2 * 2 * kIndexDim)).get();
  const EntryCodec* c128a_rows = codecs_.emplace_back(make_f32_codec(2 * kKvDim)).get();

  auto store = [&](const EntryCodec* codec, CacheGroup g) {
    stores_.push_back(std::make_unique<PageStore>(codec, group_entries_per_page(g), pools_[size_t(g)].capacity()));
    store_groups_.emplace_back(g, stores_.back().get());
    return stores_.back().get();
  };
  layers_.resize(size_t(config.num_layers));
  for (int l = 0; l < config.num_layers; ++l) {
    LayerCaches& c = layers_[size_t(l)];
    c.swa = store(kv, CacheGroup::kSwa);
    if (config.layer_type(l) == LayerType::kC4A) {
      c.compressed = store(kv, CacheGroup::kC4A);
      c.index_keys = store(keys, CacheGroup::kC4A);
      c.state = store(c4a_rows, CacheGroup::kC4AState);
      c.index_state = store(c4a_index_rows, CacheGroup::kC4AState);
    } else if (config.layer_type(l) == LayerType::kC128A) {
      c.compressed = store(kv, CacheGroup::kC128A);
      c.state = store(c128a_rows, CacheGroup::kC128AState);
    }
  }
}

void CacheManager::open_request(int64_t id) {
  require(!has_request(id), "request " + std::to_string(id) + " is already open");
  requests_[id];
}

void CacheManager::close_request(int64_t id) {
  RequestTables& r = request(id);
  for (CacheGroup g : kAllCacheGroups)
    for (int32_t page : r.tables[size_t(g)])
      if (page >= 0) pools_[size_t(g)].release(page);
  requests_.erase(id);
}

CacheManager::RequestTables& CacheManager::request(int64_t id) {
  auto it = requests_.find(id);
  require(it != requests_.end(), "unknown request " + std::to_string(id));
  return it->second;
}

const CacheManager::RequestTables& CacheManager::request(int64_t id) const {
  auto it = requests_.find(id);
  require(it != requests_.end(), "unknown request " + std::to_string(id));
  return it->second;
}

int64_t CacheManager::length(int64_t id) const { return request(id).length; }

int64_t CacheManager::tokens_held() const {
  int64_t n = 0;
  for (const auto& [id, r] : requests_) n += r.length;
  return n;
}

namespace {

// Entries [first, last) of group g that a run over positions [start, end) writes.
std::pair<int64_t, int64_t> written_entries(CacheGroup g, int64_t start, int64_t end) {
  const int m = group_tokens_per_entry(g);
  if (m == 1) return {start, end};
  return {start / m, end / m};  // slot j completes at position j*m + m - 1
}

}  // namespace

void CacheManager::reserve(int64_t id, int64_t start, int len) {
  RequestTables& r = request(id);
  std::array<std::vector<int64_t>, kNumCacheGroups> missing;
  for (CacheGroup g : kAllCacheGroups) {
    if (!uses(g)) continue;
    const auto [first, last] = written_entries(g, start, start + len);
    if (first >= last) continue;
    const int b = group_entries_per_page(g);
    const auto& table = r.tables[size_t(g)];
    for (int64_t blk = first / b; blk <= (last - 1) / b; ++blk)
      if (blk >= int64_t(table.size()) || table[size_t(blk)] < 0) missing[size_t(g)].push_back(blk);
    const BlockPool& pool = pools_[size_t(g)];
    if (int64_t(missing[size_t(g)].size()) > pool.free_count())
      throw Error("request " + std::to_string(id) + ": cache '" + std::string(cache_group_name(g)) +
                  "' is exhausted: positions " + std::to_string(start) + ".." + std::to_string(start + len - 1) +
                  " need " + std::to_string(missing[size_t(g)].size()) + " more pages, " +
                  std::to_string(pool.free_count()) + " of " + std::to_string(pool.capacity()) + " are free");
  }
  for (CacheGroup g : kAllCacheGroups) {
    auto& table = r.tables[size_t(g)];
    for (int64_t blk : missing[size_t(g)]) {
      if (blk >= int64_t(table.size())) table.resize(size_t(blk) + 1, -1);
      table[size_t(blk)] = pools_[size_t(g)].allocate();
    }
  }
}

void CacheManager::free_blocks_below(RequestTables& r, CacheGroup g, int64_t end_block) {
  auto& table = r.tables[size_t(g)];
  for (int64_t b = 0; b < std::min<int64_t>(end_block, int64_t(table.size())); ++b) {
    if (table[size_t(b)] >= 0) pools_[size_t(g)].release(table[size_t(b)]);
    table[size_t(b)] = -1;
  }
}

void CacheManager::commit(int64_t id, int64_t new_length) {
  RequestTables& r = request(id);
  require(new_length >= r.length, "request " + std::to_string(id) + ": length cannot shrink");
  r.length = new_length;
  // The next query (position new_length) reads the window from new_length - 127.
  const int64_t window_start = std::max<int64_t>(0, new_length - 127);
  free_blocks_below(r, CacheGroup::kSwa, window_start / group_entries_per_page(CacheGroup::kSwa));
  // The next C4A slot j = L/4 pools blocks j-1 and j; the next C128A slot, block L/128.
  free_blocks_below(r, CacheGroup::kC4AState, new_length / 4 - 1);
  free_blocks_below(r, CacheGroup::kC128AState, new_length / 128);
}

int32_t CacheManager::slot(CacheGroup g, int64_t id, int64_t entry) const {
  const auto& table = request(id).tables[size_t(g)];
  const int b = group_entries_per_page(g);
  const int64_t blk = entry / b;
  require(entry >= 0 && blk < int64_t(table.size()) && table[size_t(blk)] >= 0,
          "request " + std::to_string(id) + ": entry " + std::to_string(entry) + " of cache '" +
              std::string(cache_group_name(g)) + "' has no page");
  return int32_t(int64_t(table[size_t(blk)]) * b + entry % b);
}

const std::vector<int32_t>& CacheManager::table(CacheGroup g, int64_t id) const {
  return request(id).tables[size_t(g)];
}

size_t CacheManager::bytes_in_use(LayerType t) const {
  size_t bytes = 0;
  for (int l = 0; l < config_.num_layers; ++l) {
    if (config_.layer_type(l) != t) continue;
    for (const auto& [g, store] : store_groups_) {
      const LayerCaches& c = layers_[size_t(l)];
      if (store == c.swa || store == c.compressed || store == c.index_keys || store == c.state ||
          store == c.index_state)
        bytes += store->page_stride() * size_t(pools_[size_t(g)].used_count());
    }
  }
  return bytes;
}

size_t CacheManager::bytes_in_use(CacheGroup g) const {
  size_t bytes = 0;
  for (const auto& [group, store] : store_groups_)
    if (group == g) bytes += store->page_stride() * size_t(pools_[size_t(g)].used_count());
  return bytes;
}

}  // namespace dsv4
