#include "cache/cache_spec.h"

#include <algorithm>

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

std::string_view cache_kind_name(CacheKind k) {
  switch (k) {
    case CacheKind::kSwa: return "swa";
    case CacheKind::kCompressed: return "compressed";
    case CacheKind::kIndexKeys: return "index_keys";
    case CacheKind::kState: return "state";
    case CacheKind::kIndexState: return "index_state";
  }
  return "?";
}

size_t entry_page_stride(EntryFormat f, int entries_per_page, int dim) {
  switch (f) {
    case EntryFormat::kFp8DsMla: return fp8_ds_mla_page_stride(entries_per_page);
    case EntryFormat::kIndexFp8: return index_key_page_stride(IndexKeyFormat::kFp8, entries_per_page);
    case EntryFormat::kIndexMxfp4: return index_key_page_stride(IndexKeyFormat::kMxfp4, entries_per_page);
    case EntryFormat::kF32: return sizeof(float) * size_t(dim) * size_t(entries_per_page);
  }
  return 0;
}

CacheSpec::CacheSpec(const ModelConfig& config, const CacheFormats& formats)
    : num_layers_(config.num_layers), formats_(formats) {
  DSV4_REQUIRE(config.sliding_window == kWindow, "cache: sliding_window must be " + std::to_string(kWindow));
  // Compressed and indexer pages hold 256 raw tokens; a state page holds the
  // rows of one compression block.
  for (CacheGroup g : kAllCacheGroups)
    groups_[size_t(g)] = GroupSpec{group_entries_per_page(g), group_tokens_per_entry(g), false, 0};
  const EntryFormat kv = formats.fp8 ? EntryFormat::kFp8DsMla : EntryFormat::kF32;
  const EntryFormat keys = !formats.fp8                                       ? EntryFormat::kF32
                           : formats.index_keys == IndexKeyFormat::kFp8 ? EntryFormat::kIndexFp8
                                                                         : EntryFormat::kIndexMxfp4;
  index_.assign(size_t(config.num_layers) * kNumCacheKinds, -1);
  auto add = [&](int layer, CacheKind kind, CacheGroup g, EntryFormat f, int dim) {
    GroupSpec& gs = groups_[size_t(g)];
    const size_t stride = entry_page_stride(f, gs.entries_per_page, dim);
    index_[size_t(layer) * kNumCacheKinds + size_t(kind)] = int(arenas_.size());
    arenas_.push_back(ArenaSpec{layer, config.layer_type(layer), kind, g, f, dim, stride});
    gs.used = true;
    gs.page_bytes += stride;
  };
  for (int l = 0; l < config.num_layers; ++l) {
    add(l, CacheKind::kSwa, CacheGroup::kSwa, kv, kKvDim);
    // State rows [a | g + ape]: 2 * k * c floats, k = 2 for the overlapping C4A compressors.
    if (config.layer_type(l) == LayerType::kC4A) {
      add(l, CacheKind::kCompressed, CacheGroup::kC4A, kv, kKvDim);
      add(l, CacheKind::kIndexKeys, CacheGroup::kC4A, keys, kIndexDim);
      add(l, CacheKind::kState, CacheGroup::kC4AState, EntryFormat::kF32, 2 * 2 * kKvDim);
      add(l, CacheKind::kIndexState, CacheGroup::kC4AState, EntryFormat::kF32, 2 * 2 * kIndexDim);
    } else if (config.layer_type(l) == LayerType::kC128A) {
      add(l, CacheKind::kCompressed, CacheGroup::kC128A, kv, kKvDim);
      add(l, CacheKind::kState, CacheGroup::kC128AState, EntryFormat::kF32, 2 * kKvDim);
    }
  }
}

BlockRange CacheSpec::blocks_touched(CacheGroup g, int64_t start, int64_t len) const {
  const int64_t end = start + len, b = group(g).entries_per_page;
  if (len <= 0) return {};
  switch (g) {
    case CacheGroup::kSwa:  // the window of the first token .. the last token
      return {std::max<int64_t>(0, start - (kWindow - 1)) / b, (end - 1) / b};
    case CacheGroup::kC4A:
    case CacheGroup::kC128A: {  // every slot visible to the last token
      const int64_t slots = end / group(g).tokens_per_entry;
      return slots == 0 ? BlockRange{} : BlockRange{0, (slots - 1) / b};
    }
    case CacheGroup::kC4AState:  // slot j pools blocks j-1 and j
      return {std::max<int64_t>(0, start / 4 - 1), (end - 1) / 4};
    case CacheGroup::kC128AState:
      return {start / 128, (end - 1) / 128};
  }
  return {};
}

int64_t CacheSpec::first_live_block(CacheGroup g, int64_t length) const {
  switch (g) {
    case CacheGroup::kSwa:  // the next query (position L) reads from L - 127
      return std::max<int64_t>(0, length - (kWindow - 1)) / group(g).entries_per_page;
    case CacheGroup::kC4A:
    case CacheGroup::kC128A:  // compressed history: all kept
      return 0;
    case CacheGroup::kC4AState:  // the next C4A slot j = L/4 pools blocks j-1 and j
      return std::max<int64_t>(0, length / 4 - 1);
    case CacheGroup::kC128AState:  // the next C128A slot pools block L/128
      return length / 128;
  }
  return 0;
}

bool CacheSpec::needs_page(CacheGroup g, int64_t block, int64_t start, int64_t len) const {
  if (g != CacheGroup::kC4AState && g != CacheGroup::kC128AState) return true;
  return block * group(g).entries_per_page < start || block >= first_live_block(g, start + len);
}

}  // namespace dsv4
