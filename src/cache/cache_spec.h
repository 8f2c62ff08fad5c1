#pragma once
// What the paged caches of a model are (SPEC §6), derived from its config once:
// the cache groups and their page geometry, the arena every layer keeps in a
// group, and which blocks a run touches or a request still needs.
//
// Caches with the same page geometry form a group that shares one block pool
// and one block table per request; every layer of the group has its own
// arena under the same page ids, as in vLLM's KV-cache groups:
//   swa         every layer's window keys, 64 raw tokens per page
//   c4a         C4A main compressed entries + indexer keys, 64 entries (256 tokens) per page
//   c128a       C128A compressed entries, 2 entries (256 tokens) per page
//   c4a_state   C4A compressor state rows (main + indexer), one 4-token block per page
//   c128a_state C128A compressor state rows, one 128-token block per page
#include <array>
#include <cstddef>
#include <cstdint>
#include <string_view>
#include <vector>

#include "cache/index_key_format.h"
#include "model/config.h"

namespace dsv4 {

// The sliding window W of SPEC §1: a query at position t sees raw tokens
// max(0, t - 127) .. t. The one place the constant lives; configs are
// validated against it.
inline constexpr int kWindow = 128;

enum class CacheGroup : int { kSwa = 0, kC4A, kC128A, kC4AState, kC128AState };
inline constexpr int kNumCacheGroups = 5;
inline constexpr std::array<CacheGroup, kNumCacheGroups> kAllCacheGroups = {
    CacheGroup::kSwa, CacheGroup::kC4A, CacheGroup::kC128A, CacheGroup::kC4AState, CacheGroup::kC128AState};
std::string_view cache_group_name(CacheGroup g);

// Page geometry per group (SPEC §6), shared by host and device code:
// entries per page, and raw tokens per entry (compressed groups hold one entry
// per 4 or 128 tokens; the others one per token). Functions, not arrays: a
// namespace-scope constexpr array indexed at run time does not exist on the
// device (measured: a trap in the device step builder).
constexpr int group_entries_per_page(CacheGroup g) {
  switch (g) {
    case CacheGroup::kSwa: return 64;
    case CacheGroup::kC4A: return 64;
    case CacheGroup::kC128A: return 2;
    case CacheGroup::kC4AState: return 4;
    case CacheGroup::kC128AState: return 128;
  }
  return 1;
}
constexpr int group_tokens_per_entry(CacheGroup g) {
  return g == CacheGroup::kC4A ? 4 : g == CacheGroup::kC128A ? 128 : 1;
}
// The compressed groups grow with a request's context; the SWA window and the
// compressor state are bounded per request.
constexpr bool group_grows_with_context(CacheGroup g) { return group_tokens_per_entry(g) > 1; }

// What one layer keeps in a group.
enum class CacheKind : int { kSwa = 0, kCompressed, kIndexKeys, kState, kIndexState };
inline constexpr int kNumCacheKinds = 5;
std::string_view cache_kind_name(CacheKind k);

// Byte layout of one entry (SPEC §6): the production formats, or float32
// entries (the exact profile's caches and every compressor state row).
enum class EntryFormat { kFp8DsMla, kIndexFp8, kIndexMxfp4, kF32 };

struct CacheFormats {
  bool fp8 = true;  // production byte formats; false: float32 entries (exact profile)
  IndexKeyFormat index_keys = IndexKeyFormat::kMxfp4;
};

struct GroupSpec {
  int entries_per_page = 1;
  int tokens_per_entry = 1;  // raw tokens per entry: 4 or 128 for compressed groups, else 1
  bool used = false;         // some layer keeps an arena in it
  size_t page_bytes = 0;     // one page id's bytes over all the group's arenas
};

struct ArenaSpec {
  int layer = 0;
  LayerType layer_type = LayerType::kSwaOnly;
  CacheKind kind = CacheKind::kSwa;
  CacheGroup group = CacheGroup::kSwa;
  EntryFormat format = EntryFormat::kF32;
  int dim = 0;             // floats per entry
  size_t page_stride = 0;  // bytes per page
};

// Logical blocks [first, last] of a group; empty when first > last.
struct BlockRange {
  int64_t first = 0, last = -1;
  bool empty() const { return first > last; }
};

class CacheSpec {
 public:
  CacheSpec(const ModelConfig& config, const CacheFormats& formats);

  const GroupSpec& group(CacheGroup g) const { return groups_[size_t(g)]; }
  const std::vector<ArenaSpec>& arenas() const { return arenas_; }
  // Index into arenas() of a layer's cache of one kind, or -1 when it has none.
  int arena_index(int layer, CacheKind k) const { return index_[size_t(layer) * kNumCacheKinds + size_t(k)]; }
  int num_layers() const { return num_layers_; }
  const CacheFormats& formats() const { return formats_; }

  // Blocks a run over positions [start, start + len) reads or writes: its own
  // entries, the windows of its tokens, the compressed history, the state rows
  // its block ends pool. Every one must hold a page before the run executes.
  BlockRange blocks_touched(CacheGroup g, int64_t start, int64_t len) const;
  // The first block a request holding `length` tokens can still read: pages
  // below it (SWA pages out of the window, consumed state rows) can go back.
  int64_t first_live_block(CacheGroup g, int64_t length) const;
  // Whether block `block` of blocks_touched, new to the run (no page held),
  // needs a page: all do but a compressor state block that the run's own
  // tokens fill and no later token reads (below first_live_block(start +
  // len)). The compressors pool a step's own rows from its projection
  // (attn/compressor_params.h), so those rows would be written, never read:
  // at a chunk of 8,192 tokens of V4-Flash about 2.4 GB.
  bool needs_page(CacheGroup g, int64_t block, int64_t start, int64_t len) const;

 private:
  int num_layers_ = 0;
  CacheFormats formats_;
  std::array<GroupSpec, kNumCacheGroups> groups_{};
  std::vector<ArenaSpec> arenas_;
  std::vector<int> index_;
};

// Bytes per page of an entry format, and floats per entry.
size_t entry_page_stride(EntryFormat f, int entries_per_page, int dim);

}  // namespace dsv4
