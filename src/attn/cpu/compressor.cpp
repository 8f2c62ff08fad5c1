#include "attn/cpu/compressor.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "numerics/bf16.h"
#include "numerics/hadamard.h"
#include "common/error.h"
#include "numerics/rmsnorm.h"

namespace dsv4 {

CompressorOp::CompressorOp(const CompressorWeights& w, Profile profile, bool cache_weights, const Rope& rope,
                           float eps, bool index_keys)
    : w_(w), profile_(profile), rope_(rope), eps_(eps), index_keys_(index_keys),
      wkv_(&w.wkv, LinearMode::kF32, cache_weights), wgate_(&w.wgate, LinearMode::kF32, cache_weights) {}

void CompressorOp::pool(int run, int64_t slot_j, const CompressorIo& io,
                        std::vector<float>& rows, float* v) const {
  const int m = w_.ratio, c = w_.dim, kc = w_.coff * c, row = 2 * kc;
  // m = 4 pools blocks j-1 (A half) and j (B half); block -1 does not exist.
  const int64_t first = m == 4 ? std::max<int64_t>(0, (slot_j - 1) * m) : slot_j * m;
  const int64_t last = slot_j * m + m;  // exclusive
  const int n = int(last - first);
  rows.resize(size_t(n) * row);
  for (int i = 0; i < n; ++i) {
    io.state.read(block_table_slot(io.state_table, run, first + i), rows.data() + size_t(i) * row);
  }
  for (int e = 0; e < c; ++e) {
    // Channel e: token i contributes (a, g) from its A half when it belongs to
    // block j-1, from its B half (offset c) when it belongs to block j.
    auto half = [&](int i) { return (m == 4 && first + i >= slot_j * m) ? c : 0; };
    float mx = -std::numeric_limits<float>::infinity();
    for (int i = 0; i < n; ++i) mx = std::max(mx, rows[size_t(i) * row + kc + half(i) + e]);
    float den = 0, num = 0;
    for (int i = 0; i < n; ++i) {
      const float* r = rows.data() + size_t(i) * row;
      const float wgt = std::exp(r[kc + half(i) + e] - mx);
      den += wgt;
      num += wgt * r[half(i) + e];
    }
    v[e] = num / den;
  }
}

void CompressorOp::finish_entry(float* v, int64_t slot_j) const {
  const int c = w_.dim;
  const bool prod = profile_ == Profile::kProduction;
  if (prod) round_bf16(v, size_t(c));  // the pooled vector is rounded before its norm
  rms_norm(v, w_.norm.data(), c, eps_, v);
  if (prod) round_bf16(v, size_t(c));
  rope_.apply(v + c - kRopeDim, slot_j * w_.ratio);
  if (prod) round_bf16(v + c - kRopeDim, kRopeDim);
  if (prod && index_keys_) {
    hadamard_rotate(v, c);
    round_bf16(v, size_t(c));
  }
}

std::vector<int> CompressorOp::forward(const StepView& s, const float* x, const CompressorIo& io) const {
  const int T = s.dims.tokens, m = w_.ratio, kc = w_.coff * w_.dim;
  std::vector<float> rows_out(size_t(T) * 2 * kc), a(size_t(T) * kc), g(size_t(T) * kc);
  wkv_.forward(x, T, a.data(), profile_);
  wgate_.forward(x, T, g.data(), profile_);
#pragma omp parallel for
  for (int t = 0; t < T; ++t) {
    float* r = rows_out.data() + size_t(t) * 2 * kc;
    const float* ape = w_.ape.data() + size_t(s.positions[t] % m) * kc;  // the ape enters the gate only
    for (int i = 0; i < kc; ++i) {
      r[i] = a[size_t(t) * kc + i];
      r[kc + i] = g[size_t(t) * kc + i] + ape[i];
    }
    if (io.state_slots[t] >= 0) io.state.write(io.state_slots[t], r);
  }
  // Checked here, outside the parallel region (an exception must not leave
  // one): every row a completed block pools has a page.
  std::vector<int> done;
  for (int t = 0; t < T; ++t) {
    if (io.out_slots[t] < 0) continue;
    const int64_t j = (s.positions[t] + 1) / m - 1;
    for (int64_t p = m == 4 ? std::max<int64_t>(0, (j - 1) * m) : j * m; p < j * m + m; ++p)
      DSV4_REQUIRE(block_table_slot(io.state_table, s.token_run[t], p) >= 0,
              "compressor: state row " + std::to_string(p) + " of a pooled block has no page");
    done.push_back(t);
  }
#pragma omp parallel
  {
    std::vector<float> rows, v(size_t(w_.dim));
#pragma omp for schedule(dynamic)
    for (size_t i = 0; i < done.size(); ++i) {
      const int t = done[i];
      const int64_t slot_j = (s.positions[t] + 1) / m - 1;
      pool(s.token_run[t], slot_j, io, rows, v.data());
      finish_entry(v.data(), slot_j);
      io.out.write(io.out_slots[t], v.data());
    }
  }
  return done;
}

}  // namespace dsv4
