#include "attn/compressor_params.h"

#include <algorithm>
#include <string>

#include "cache/fp8_ds_mla.h"
#include "common/error.h"

namespace dsv4 {

void check_compressor_params(const CompressorParams& p) {
  const std::string what = "compressor: ";
  DSV4_REQUIRE(p.num_tokens >= 0, what + "negative token count");
  if (p.num_tokens == 0) return;
  DSV4_REQUIRE(p.ratio == 4 || p.ratio == 128, what + "ratio must be 4 or 128, not " + std::to_string(p.ratio));
  DSV4_REQUIRE(p.dim == 512 || p.dim == 128, what + "dim must be 512 or 128, not " + std::to_string(p.dim));
  const bool index_record = p.record == EntryFormat::kIndexFp8 || p.record == EntryFormat::kIndexMxfp4;
  DSV4_REQUIRE(p.record != EntryFormat::kFp8DsMla || p.dim == kKvDim, what + "fp8_ds_mla records need dim 512");
  DSV4_REQUIRE(!index_record || p.dim == kIndexDim, what + "indexer key records need dim 128");
  DSV4_REQUIRE(p.proj && p.ape && p.norm && p.rope, what + "proj, ape, norm and rope are required");
  DSV4_REQUIRE(p.positions && p.token_run && p.row_slot && p.entry_slot,
          what + "positions, token_run, row_slot and entry_slot are required");
  DSV4_REQUIRE(p.a_col >= 0 && p.proj_ld >= int64_t(p.g_col()) + p.kc(),
          what + "the a and g columns must lie inside a row of proj (proj_ld " + std::to_string(p.proj_ld) + ")");
  DSV4_REQUIRE(p.state.base && p.state.num_pages > 0 && p.state.entries_per_page > 0, what + "no state pages");
  DSV4_REQUIRE(p.state.page_stride >= sizeof(float) * size_t(p.row_floats()) * size_t(p.state.entries_per_page),
          what + "state page stride smaller than its rows");
  DSV4_REQUIRE(p.state_table.entries_per_page == p.state.entries_per_page,
          what + "the state table's entries_per_page differs from the state cache's");
  DSV4_REQUIRE(p.state_table.width >= 0 && (p.state_table.width == 0 || (p.state_table.pages && p.state_table.first)),
          what + "state table without pages or first blocks");
  DSV4_REQUIRE(p.out.base && p.out.num_pages > 0 && p.out.entries_per_page > 0, what + "no output pages");
  DSV4_REQUIRE(p.out.page_stride >= entry_page_stride(p.record, p.out.entries_per_page, p.dim),
          what + "output page stride smaller than its records");
}

}  // namespace dsv4
