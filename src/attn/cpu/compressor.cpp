#include "attn/cpu/compressor.h"

#include <algorithm>
#include <string>

#include "attn/compressor_math.h"
#include "common/error.h"

namespace dsv4 {

CompressorOp::CompressorOp(const CompressorWeights& w, Profile profile, bool cache_weights, const Rope& rope,
                           float eps, bool index_keys)
    : w_(w), profile_(profile), rope_(rope), eps_(eps), index_keys_(index_keys),
      wkv_(&w.wkv, LinearMode::kF32, cache_weights), wgate_(&w.wgate, LinearMode::kF32, cache_weights) {}

std::vector<int> CompressorOp::forward(const StepView& s, const float* x, const CompressorIo& io,
                                       CpuScratch& ws) const {
  const int T = s.dims.tokens, m = w_.ratio, kc = w_.coff * w_.dim;
  // [a | g] per token, the layout compress_cpu reads.
  float* proj = sized(ws.proj, size_t(T) * 2 * kc);
  wkv_.forward(x, int(w_.wkv.cols), T, proj, 2 * kc, profile_);
  wgate_.forward(x, int(w_.wgate.cols), T, proj + kc, 2 * kc, profile_);
  // Every row a completed block pools is a row of this step or has a page
  // (the block manager reserved those); checked here, since compress_cpu
  // skips unmapped rows.
  std::vector<int> done;
  for (int t = 0; t < T; ++t) {
    if (io.out_slots[t] < 0) continue;
    const int64_t j = pool::slot_of_position(s.positions[t], m), first = pool::pool_first(j, m);
    for (int64_t p = first; p < first + pool::pool_count(j, m); ++p) {
      const bool in_step = pool::step_row_token(s.positions, s.token_run, t, p) >= 0;
      DSV4_REQUIRE(in_step || block_table_slot(io.state_table, s.token_run[t], p) >= 0,
                   "compressor: state row " + std::to_string(p) + " of a pooled block has no page");
    }
    done.push_back(t);
  }
  const bool prod = profile_ == Profile::kProduction;
  CompressorParams p;
  p.num_tokens = T;
  p.ratio = m;
  p.dim = w_.dim;
  p.proj = proj;
  p.proj_ld = 2 * kc;
  p.a_col = 0;
  p.ape = w_.ape.data();
  p.norm = w_.norm.data();
  p.eps = eps_;
  p.rope = &rope_;
  p.positions = s.positions;
  p.token_run = s.token_run;
  p.row_slot = io.state_slots;
  p.entry_slot = io.out_slots;
  p.state_table = io.state_table;
  p.state = io.state.pages;
  p.out = io.out.pages;
  p.record = io.out.format;
  p.bf16_rounding = prod;
  p.hadamard = prod && index_keys_;
  compress_cpu(p);
  return done;
}

}  // namespace dsv4
