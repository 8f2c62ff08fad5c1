#pragma once
// The flat form of a step's metadata (SPEC §7): int32 arrays at fixed
// offsets of one buffer, so one copy puts a step on a GPU, and the functions
// that derive the per-token lists from positions and block tables. Host and
// device code share all of it: the CPU builds a step by running derive_token
// over its tokens; a GPU backend copies the input arrays and runs the same
// function in a kernel.
//
// Buffer: a header of kStepHeaderInts ints (the dims), then the inputs
// (positions, token -> run, per-run start/length/first token, per-group
// block tables), then the derived arrays (slot mappings, window lists, C128A
// lists). Every array starts at a multiple of 4 ints (16 bytes).
#include <cstdint>

#include "cache/block_table.h"
#include "cache/cache_spec.h"
#include "common/hd.h"

namespace dsv4 {

struct StepDims {
  int32_t tokens = 0, runs = 0;
  int32_t table_width[kNumCacheGroups] = {};  // blocks per row of each group's table
  int32_t c128a_width = 0;                    // C128A list width, a multiple of 64
};
inline constexpr int kStepHeaderInts = 8;  // the fields of StepDims, in order

struct StepLayout {
  int64_t positions = 0, token_run = 0, run_start = 0, run_len = 0, run_token_begin = 0;
  int64_t table_first[kNumCacheGroups] = {}, table_pages[kNumCacheGroups] = {};
  int64_t inputs_end = 0;  // [0, inputs_end): header and inputs; the rest is derived
  int64_t swa_slot = 0, c4a_slot = 0, c128a_slot = 0, c4a_state_slot = 0, c128a_state_slot = 0;
  int64_t window_indices = 0, window_lengths = 0, c128a_indices = 0, c128a_lengths = 0;
  int64_t total = 0;  // ints
};

constexpr int64_t round_up4(int64_t n) { return (n + 3) / 4 * 4; }

constexpr StepLayout step_layout(const StepDims& d) {
  StepLayout l;
  int64_t at = kStepHeaderInts;
  auto take = [&at](int64_t n) {
    const int64_t off = at;
    at += round_up4(n);
    return off;
  };
  const int64_t T = d.tokens, R = d.runs;
  l.positions = take(T);
  l.token_run = take(T);
  l.run_start = take(R);
  l.run_len = take(R);
  l.run_token_begin = take(R + 1);
  for (int g = 0; g < kNumCacheGroups; ++g) {
    l.table_first[g] = take(R);
    l.table_pages[g] = take(R * d.table_width[g]);
  }
  l.inputs_end = at;
  l.swa_slot = take(T);
  l.c4a_slot = take(T);
  l.c128a_slot = take(T);
  l.c4a_state_slot = take(T);
  l.c128a_state_slot = take(T);
  l.window_indices = take(T * kWindow);
  l.window_lengths = take(T);
  l.c128a_indices = take(T * d.c128a_width);
  l.c128a_lengths = take(T);
  l.total = at;
  return l;
}

// Pointers to every array of a step buffer (host or device memory).
struct StepView {
  StepDims dims;
  const int32_t* positions;
  const int32_t* token_run;
  const int32_t* run_start;
  const int32_t* run_len;
  const int32_t* run_token_begin;
  BlockTableView tables[kNumCacheGroups];
  int32_t* swa_slot;
  int32_t* c4a_slot;
  int32_t* c128a_slot;
  int32_t* c4a_state_slot;
  int32_t* c128a_state_slot;
  int32_t* window_indices;  // [T, kWindow]
  int32_t* window_lengths;  // [T]
  int32_t* c128a_indices;   // [T, c128a_width]
  int32_t* c128a_lengths;   // [T]

  constexpr const BlockTableView& table(CacheGroup g) const { return tables[int(g)]; }
};

constexpr StepView step_view(int32_t* base, const StepDims& d) {
  const StepLayout l = step_layout(d);
  StepView v{};
  v.dims = d;
  v.positions = base + l.positions;
  v.token_run = base + l.token_run;
  v.run_start = base + l.run_start;
  v.run_len = base + l.run_len;
  v.run_token_begin = base + l.run_token_begin;
  for (int g = 0; g < kNumCacheGroups; ++g)
    v.tables[g] = BlockTableView{base + l.table_pages[g], base + l.table_first[g], d.table_width[g],
                                 group_entries_per_page(CacheGroup(g))};
  v.swa_slot = base + l.swa_slot;
  v.c4a_slot = base + l.c4a_slot;
  v.c128a_slot = base + l.c128a_slot;
  v.c4a_state_slot = base + l.c4a_state_slot;
  v.c128a_state_slot = base + l.c128a_state_slot;
  v.window_indices = base + l.window_indices;
  v.window_lengths = base + l.window_lengths;
  v.c128a_indices = base + l.c128a_indices;
  v.c128a_lengths = base + l.c128a_lengths;
  return v;
}

// Header <-> dims.
constexpr void write_step_header(int32_t* base, const StepDims& d) {
  base[0] = d.tokens;
  base[1] = d.runs;
  for (int g = 0; g < kNumCacheGroups; ++g) base[2 + g] = d.table_width[g];
  base[7] = d.c128a_width;
}
constexpr StepDims read_step_header(const int32_t* base) {
  StepDims d;
  d.tokens = base[0];
  d.runs = base[1];
  for (int g = 0; g < kNumCacheGroups; ++g) d.table_width[g] = base[2 + g];
  d.c128a_width = base[7];
  return d;
}

// Slot of the compressed entry token position `pos` completes (SPEC §7: only
// (pos + 1) % m == 0 writes one), or -1.
constexpr int32_t completed_slot(const StepView& v, CacheGroup g, int run, int64_t pos) {
  const int m = group_tokens_per_entry(g);
  return (pos + 1) % m == 0 ? block_table_slot(v.table(g), run, (pos + 1) / m - 1) : -1;
}

// The derived arrays of token t, one element at a time, so the CPU can loop
// and a GPU can spread a token's lists over threads with the same code:
// slot mappings; the window list (global SWA slots of positions
// pos-127 .. pos, -1 padded); the C128A list (every visible compressed slot
// j < (pos + 1) / 128, -1 padded). A group without a table (width 0) maps to -1.
constexpr int window_length(int64_t pos) { return pos + 1 < kWindow ? int(pos + 1) : kWindow; }

constexpr int32_t window_entry(const StepView& v, int t, int i) {
  const int64_t pos = v.positions[t];
  const int len = window_length(pos);
  return i < len ? block_table_slot(v.table(CacheGroup::kSwa), v.token_run[t], pos - len + 1 + i) : -1;
}

constexpr int32_t c128a_visible(const StepView& v, int t) {
  const int64_t visible = (int64_t(v.positions[t]) + 1) / 128;
  return visible < v.dims.c128a_width ? int32_t(visible) : v.dims.c128a_width;
}

constexpr int32_t c128a_entry(const StepView& v, int t, int j) {
  return j < c128a_visible(v, t) ? block_table_slot(v.table(CacheGroup::kC128A), v.token_run[t], j) : -1;
}

constexpr void derive_slots(const StepView& v, int t) {
  const int r = v.token_run[t];
  const int64_t pos = v.positions[t];
  v.swa_slot[t] = block_table_slot(v.table(CacheGroup::kSwa), r, pos);
  v.c4a_slot[t] = completed_slot(v, CacheGroup::kC4A, r, pos);
  v.c128a_slot[t] = completed_slot(v, CacheGroup::kC128A, r, pos);
  v.c4a_state_slot[t] = block_table_slot(v.table(CacheGroup::kC4AState), r, pos);
  v.c128a_state_slot[t] = block_table_slot(v.table(CacheGroup::kC128AState), r, pos);
  v.window_lengths[t] = window_length(pos);
  v.c128a_lengths[t] = c128a_visible(v, t);
}

// A padding row (a decode step padded to a CUDA graph's batch size): no
// slot, empty lists, so it reads and writes nothing.
constexpr void derive_padding_slots(const StepView& v, int t) {
  v.swa_slot[t] = v.c4a_slot[t] = v.c128a_slot[t] = v.c4a_state_slot[t] = v.c128a_state_slot[t] = -1;
  v.window_lengths[t] = v.c128a_lengths[t] = 0;
}

// Every derived array's row of token t (the CPU's loop body).
constexpr void derive_token(const StepView& v, int t) {
  derive_slots(v, t);
  int32_t* win = v.window_indices + int64_t(t) * kWindow;
  for (int i = 0; i < kWindow; ++i) win[i] = window_entry(v, t, i);
  int32_t* list = v.c128a_indices + int64_t(t) * v.dims.c128a_width;
  for (int j = 0; j < v.dims.c128a_width; ++j) list[j] = c128a_entry(v, t, j);
}

}  // namespace dsv4
