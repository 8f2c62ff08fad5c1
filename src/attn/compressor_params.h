#pragma once
// One compressor call of a step (SPEC §4.3, §5 "Compressor in fp32", §6 state
// rows), the same struct for both backends: compress_cpu (attn/cpu/compress_cpu.h)
// takes host pointers, compressor_cuda (attn/cuda/compressor_cuda.h) device
// pointers. The call runs in two phases:
//  1. every token t with row_slot[t] >= 0 writes its state row
//     [a | g + ape[pos % m]] (2*k*c floats) at state slot row_slot[t];
//  2. every token t with entry_slot[t] >= 0 completes compressed slot
//     j = (pos + 1) / m - 1: it pools the rows of positions
//     max(0, (j-1)*m) .. j*m + m - 1 (m = 4) or j*m .. j*m + m - 1 (m = 128),
//     then finishes the entry (bf16, RMSNorm, bf16, RoPE at j*m, bf16,
//     optional Hadamard + bf16) and writes the record at out slot
//     entry_slot[t]. A pooled position that a token of t's run in this step
//     holds (pool::step_token finds it) is that token's row, built from its
//     projection whether or not it has a row slot; any other is read through
//     the state block table of t's run.
// A slot beyond its cache's capacity writes nothing; a pooled row that the
// table does not map (or maps beyond the state capacity) is skipped, like
// the absent block -1 of slot 0. So a state block that only this step's
// tokens fill and no later token reads needs no page (the block manager
// gives it none: CacheSpec::needs_page).
#include <cstddef>
#include <cstdint>

#include "cache/block_table.h"
#include "cache/cache_spec.h"
#include "cache/pages.h"

namespace dsv4 {

class Rope;

struct CompressorParams {
  int num_tokens = 0;
  int ratio = 0;  // m: 4 (overlapping, k = 2) or 128 (k = 1)
  int dim = 0;    // c: 512 (main) or 128 (indexer)

  // Projections, fp32 [T, proj_ld]: a = x wkv^T at columns [a_col, a_col + k*c),
  // g = x wgate^T right after it, at [g_col(), g_col() + k*c): a row of this
  // step is pooled straight from there (step 2), as a state row [a | g + ape].
  const float* proj = nullptr;
  int64_t proj_ld = 0;
  int a_col = 0;
  const float* ape = nullptr;   // [m, k*c] fp32, enters the gate only
  const float* norm = nullptr;  // [c] RMSNorm weight
  float eps = 1e-6f;
  // The layer's RoPE (a host object on both backends: the CUDA launcher
  // passes its 32 inv_freq values by value).
  const Rope* rope = nullptr;

  // Step metadata, [T] each.
  const int32_t* positions = nullptr;
  const int32_t* token_run = nullptr;   // the token's run: its row of state_table
  const int32_t* row_slot = nullptr;    // state slot of the token's own row, -1: none
  const int32_t* entry_slot = nullptr;  // out slot of the entry it completes, -1: none

  BlockTableView state_table;  // rows by position; entries_per_page = state.entries_per_page
  KvPagesMut state;            // f32 rows: row t of a page at byte 4 * row_floats() * t
  KvPagesMut out;              // records in `record`'s page layout

  EntryFormat record = EntryFormat::kFp8DsMla;
  bool bf16_rounding = true;  // production numerics (SPEC §5); false: exact profile
  bool hadamard = false;      // rotate the finished entry (production indexer keys)

  constexpr int coff() const { return ratio == 4 ? 2 : 1; }
  constexpr int kc() const { return coff() * dim; }
  constexpr int row_floats() const { return 2 * kc(); }
  constexpr int g_col() const { return a_col + kc(); }
};

// Throws Error naming the first problem: shapes, null pointers, page
// geometry (the backends add their own alignment checks).
void check_compressor_params(const CompressorParams& p);

}  // namespace dsv4
