#include "attn/cpu/compressor.h"

#include <algorithm>
#include <cstring>
#include <string>

#include "attn/compressor_math.h"
#include "cache/fp8_ds_mla.h"
#include "cache/index_key_format.h"
#include "common/error.h"
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
  for (int e = 0; e < c; ++e) v[e] = pool::pool_channel(row, n, b_from, b_off, kc, e);
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

void compressor_encode(CompressedRecord record, const float* v, int c, uint8_t* page, int B, int t) {
  switch (record) {
    case CompressedRecord::kFp8DsMla: fp8_ds_mla_encode(v, page, B, t); return;
    case CompressedRecord::kIndexFp8: index_key_encode(IndexKeyFormat::kFp8, v, page, B, t); return;
    case CompressedRecord::kIndexMxfp4: index_key_encode(IndexKeyFormat::kMxfp4, v, page, B, t); return;
    case CompressedRecord::kF32:
      std::memcpy(page + sizeof(float) * size_t(c) * size_t(t), v, sizeof(float) * size_t(c));
  }
}

// ---- CompressorOp ----------------------------------------------------------------

CompressorOp::CompressorOp(const CompressorWeights& w, Profile profile, bool cache_weights, const Rope& rope,
                           float eps, bool index_keys)
    : w_(w), profile_(profile), rope_(rope), eps_(eps), index_keys_(index_keys),
      wkv_(&w.wkv, LinearMode::kF32, cache_weights), wgate_(&w.wgate, LinearMode::kF32, cache_weights) {}

void CompressorOp::pool(int run, int64_t slot_j, const CompressorIo& io, std::vector<float>& rows,
                        float* v) const {
  const int m = w_.ratio, row = 2 * w_.coff * w_.dim;
  const int64_t first = pool::pool_first(slot_j, m);
  const int n = pool::pool_count(slot_j, m);
  rows.resize(size_t(n) * row);
  std::vector<const float*> ptrs(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) {
    const int32_t slot = StepMetadata::map_slot((*io.state_tables)[size_t(run)], io.state_group, first + i);
    io.state->read(slot, rows.data() + size_t(i) * row);
    ptrs[size_t(i)] = rows.data() + size_t(i) * row;
  }
  compressor_pool(ptrs.data(), slot_j, m, w_.dim, v);
}

std::vector<int> CompressorOp::forward(const StepMetadata& s, const float* x, const CompressorIo& io) const {
  const int T = s.num_tokens(), m = w_.ratio, kc = w_.coff * w_.dim;
  std::vector<float> rows_out(size_t(T) * 2 * kc), a(size_t(T) * kc), g(size_t(T) * kc);
  wkv_.forward(x, T, a.data(), profile_);
  wgate_.forward(x, T, g.data(), profile_);
#pragma omp parallel for
  for (int t = 0; t < T; ++t) {
    float* r = rows_out.data() + size_t(t) * 2 * kc;
    const float* ape = w_.ape.data() + size_t(s.positions[size_t(t)] % m) * kc;
    compressor_state_row(a.data() + size_t(t) * kc, g.data() + size_t(t) * kc, ape, kc, r);
    io.state->write((*io.state_slots)[size_t(t)], r);
  }
  std::vector<int> done;
  for (int t = 0; t < T; ++t)
    if ((*io.out_slots)[size_t(t)] >= 0) done.push_back(t);
  const bool prod = profile_ == Profile::kProduction;
#pragma omp parallel
  {
    std::vector<float> rows, v(size_t(w_.dim));
#pragma omp for schedule(dynamic)
    for (size_t i = 0; i < done.size(); ++i) {
      const int t = done[i];
      const int64_t slot_j = pool::slot_of_position(s.positions[size_t(t)], m);
      pool(s.token_run[size_t(t)], slot_j, io, rows, v.data());
      compressor_finish(v.data(), w_.dim, w_.norm.data(), eps_, rope_, slot_j * m, prod, prod && index_keys_);
      io.out->write((*io.out_slots)[size_t(t)], v.data());
    }
  }
  return done;
}

// ---- compress_cpu -------------------------------------------------------------------

namespace {

// Row of state slot `slot` in the (host) state cache, nullptr when out of range.
float* state_row(const CompressorParams& p, int64_t slot) {
  if (slot < 0 || slot >= p.state.capacity()) return nullptr;
  const int B = p.state.entries_per_page;
  return reinterpret_cast<float*>(p.state.page(slot / B) + sizeof(float) * size_t(p.row_floats()) * size_t(slot % B));
}

}  // namespace

void compress_pool_cpu(const CompressorParams& p, int t, float* v) {
  const int m = p.ratio;
  const int64_t j = pool::slot_of_position(p.positions[t], m), first = pool::pool_first(j, m);
  const int n = pool::pool_count(j, m);
  std::vector<const float*> rows(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i)
    rows[size_t(i)] = state_row(p, block_table_slot(p.state_table, p.token_run[t], first + i));
  compressor_pool(rows.data(), j, m, p.dim, v);
}

void compress_cpu(const CompressorParams& p) {
  check_compressor_params(p);
  const int T = p.num_tokens, m = p.ratio, kc = p.kc();
  for (int t = 0; t < T; ++t) {
    float* row = state_row(p, p.row_slot[t]);
    if (!row) continue;
    const float* x = p.proj + size_t(t) * size_t(p.proj_ld);
    compressor_state_row(x + p.a_col, x + p.g_col, p.ape + size_t(p.positions[t] % m) * size_t(kc), kc, row);
  }
  std::vector<float> v(size_t(p.dim));
  for (int t = 0; t < T; ++t) {
    const int64_t slot = p.entry_slot[t];
    if (slot < 0 || slot >= p.out.capacity()) continue;
    const int64_t j = pool::slot_of_position(p.positions[t], m);
    if (j < 0) continue;  // no complete block before this position
    compress_pool_cpu(p, t, v.data());
    compressor_finish(v.data(), p.dim, p.norm, p.eps, *p.rope, j * m, p.bf16_rounding, p.hadamard);
    const int B = p.out.entries_per_page;
    compressor_encode(p.record, v.data(), p.dim, p.out.page(slot / B), B, int(slot % B));
  }
}

}  // namespace dsv4
