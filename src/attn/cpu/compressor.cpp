#include "attn/cpu/compressor.h"

#include "attn/compressor_math.h"

namespace dsv4 {

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

}  // namespace dsv4
