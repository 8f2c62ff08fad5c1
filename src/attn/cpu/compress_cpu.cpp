#include "attn/cpu/compress_cpu.h"

#include <cstring>
#include <vector>

#include "attn/compressor_math.h"
#include "cache/fp8_ds_mla.h"
#include "cache/index_key_format.h"
#include "numerics/bf16.h"
#include "numerics/hadamard.h"
#include "numerics/rmsnorm.h"

namespace dsv4 {

// ---- shared pieces -------------------------------------------------------------

void compressor_state_row(const float* a, const float* g, const float* ape_row, int kc, float* row) {
  for (int i = 0; i < kc; ++i) {
    row[i] = a[i];
    row[kc + i] = g[i] + ape_row[i];  // the ape enters the gate only
  }
}

void compressor_pool(const float* const* rows, int64_t slot_j, int m, int c, float* v) {
  const int n = pool::pool_count(slot_j, m), kc = (m == 4 ? 2 : 1) * c;
  // m = 4: rows of block j (from index b_from on) contribute their B half.
  const int b_from = int(slot_j * m - pool::pool_first(slot_j, m)), b_off = m == 4 ? c : 0;
  auto row = [rows](int i) { return rows[i]; };
  for (int e = 0; e < c; ++e) v[e] = pool::pool_channel<8>(row, n, b_from, b_off, kc, e);
}

void compressor_finish(float* v, int c, const float* norm, float eps, const Rope& rope, int64_t rope_pos,
                       bool bf16_rounding, bool hadamard) {
  if (bf16_rounding) round_bf16(v, size_t(c));  // the pooled vector is rounded before its norm
  rms_norm(v, norm, c, eps, v);
  if (bf16_rounding) round_bf16(v, size_t(c));
  rope.apply(v + c - kRopeDim, rope_pos);
  if (bf16_rounding) round_bf16(v + c - kRopeDim, kRopeDim);
  if (hadamard) {
    hadamard_rotate(v, c);
    if (bf16_rounding) round_bf16(v, size_t(c));
  }
}

void compressor_encode(EntryFormat record, const float* v, int c, uint8_t* page, int B, int t) {
  switch (record) {
    case EntryFormat::kFp8DsMla: fp8_ds_mla_encode(v, page, B, t); return;
    case EntryFormat::kIndexFp8: index_key_encode(IndexKeyFormat::kFp8, v, page, B, t); return;
    case EntryFormat::kIndexMxfp4: index_key_encode(IndexKeyFormat::kMxfp4, v, page, B, t); return;
    case EntryFormat::kF32:
      std::memcpy(page + sizeof(float) * size_t(c) * size_t(t), v, sizeof(float) * size_t(c));
  }
}

// ---- compress_cpu -------------------------------------------------------------------

namespace {

// Row of state slot `slot` in the (host) state cache, nullptr when out of range.
float* state_row(const CompressorParams& p, int64_t slot) {
  if (slot < 0 || slot >= p.state.capacity()) return nullptr;
  const int B = p.state.entries_per_page;
  return reinterpret_cast<float*>(p.state.page(slot / B) + sizeof(float) * size_t(p.row_floats()) * size_t(slot % B));
}

// compress_pool_cpu with the rows of this step built in `scratch`.
void pool_entry(const CompressorParams& p, int t, float* v, std::vector<float>& scratch) {
  const int m = p.ratio, kc = p.kc();
  const int64_t j = pool::slot_of_position(p.positions[t], m), first = pool::pool_first(j, m);
  const int n = pool::pool_count(j, m);
  scratch.resize(size_t(n) * size_t(p.row_floats()));
  std::vector<const float*> rows(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) {
    const int u = pool::step_row_token(p.positions, p.token_run, t, first + i);
    if (u < 0) {
      rows[size_t(i)] = state_row(p, block_table_slot(p.state_table, p.token_run[t], first + i));
      continue;
    }
    const float* x = p.proj + size_t(u) * size_t(p.proj_ld);
    float* row = scratch.data() + size_t(i) * size_t(p.row_floats());
    compressor_state_row(x + p.a_col, x + p.g_col(), p.ape + size_t((first + i) % m) * size_t(kc), kc, row);
    rows[size_t(i)] = row;
  }
  compressor_pool(rows.data(), j, m, p.dim, v);
}

}  // namespace

void compress_pool_cpu(const CompressorParams& p, int t, float* v) {
  std::vector<float> scratch;
  pool_entry(p, t, v, scratch);
}

void compress_cpu(const CompressorParams& p) {
  check_compressor_params(p);
  const int T = p.num_tokens, m = p.ratio, kc = p.kc();
  for (int t = 0; t < T; ++t) {
    float* row = state_row(p, p.row_slot[t]);
    if (!row) continue;
    const float* x = p.proj + size_t(t) * size_t(p.proj_ld);
    compressor_state_row(x + p.a_col, x + p.g_col(), p.ape + size_t(p.positions[t] % m) * size_t(kc), kc, row);
  }
  std::vector<float> v(size_t(p.dim)), scratch;
  for (int t = 0; t < T; ++t) {
    const int64_t slot = p.entry_slot[t];
    if (slot < 0 || slot >= p.out.capacity()) continue;
    const int64_t j = pool::slot_of_position(p.positions[t], m);
    if (j < 0) continue;  // no complete block before this position
    pool_entry(p, t, v.data(), scratch);
    compressor_finish(v.data(), p.dim, p.norm, p.eps, *p.rope, j * m, p.bf16_rounding, p.hadamard);
    const int B = p.out.entries_per_page;
    compressor_encode(p.record, v.data(), p.dim, p.out.page(slot / B), B, int(slot % B));
  }
}

}  // namespace dsv4
