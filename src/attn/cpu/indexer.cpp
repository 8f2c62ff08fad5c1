#include "attn/cpu/indexer.h"

#include "attn/cpu/sgemm.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "numerics/bf16.h"
#include "numerics/hadamard.h"
#include "numerics/quant.h"

namespace dsv4 {

std::vector<int32_t> top_k(const float* scores, int64_t n, int k) {
  std::vector<int32_t> idx(static_cast<size_t>(n));
  std::iota(idx.begin(), idx.end(), 0);
  k = int(std::min<int64_t>(k, n));
  auto better = [&](int32_t a, int32_t b) { return scores[a] > scores[b] || (scores[a] == scores[b] && a < b); };
  std::partial_sort(idx.begin(), idx.begin() + k, idx.end(), better);
  idx.resize(size_t(k));
  return idx;
}

IndexerOp::IndexerOp(const IndexerWeights& w, const ModelConfig& config, Profile profile, bool cache_weights,
                     const Rope& rope, IndexKeyFormat key_format, int key_tile)
    : config_(config), profile_(profile), rope_(rope), key_format_(key_format), key_tile_(std::max(1, key_tile)),
      wq_b_(&w.wq_b, LinearMode::kFp8, cache_weights),
      weights_proj_(&w.weights_proj, LinearMode::kBf16, cache_weights) {}

void IndexerOp::queries(const StepView& s, const float* x, const float* cq, std::vector<float>& q,
                        std::vector<float>& w) const {
  const int T = s.dims.tokens, nI = config_.index_n_heads, d = kIndexDim;
  const bool prod = profile_ == Profile::kProduction;
  q.resize(size_t(T) * nI * d);
  w.resize(size_t(T) * nI);
  wq_b_.forward(cq, T, q.data(), profile_);
  weights_proj_.forward(x, T, w.data(), profile_);
  const float head_scale = float(1.0 / std::sqrt(double(d)) / std::sqrt(double(nI)));
#pragma omp parallel for
  for (int t = 0; t < T; ++t) {
    for (int h = 0; h < nI; ++h) {
      float* qh = q.data() + (size_t(t) * nI + h) * d;
      rope_.apply(qh + d - kRopeDim, s.positions[t]);
      if (!prod) continue;
      round_bf16(qh + d - kRopeDim, kRopeDim);
      // Rotated like the keys, then quantized like them (SPEC §5).
      hadamard_rotate(qh, d);
      round_bf16(qh, size_t(d));
      if (key_format_ == IndexKeyFormat::kMxfp4) fake_quant_e2m1(qh, size_t(d), kFp4QuantBlock);
      else fake_quant_e4m3(qh, size_t(d), d);
    }
    for (int h = 0; h < nI; ++h) {
      float& wh = w[size_t(t) * nI + h];
      wh = prod ? round_bf16(wh * head_scale) : wh * head_scale;
    }
  }
}

void IndexerOp::score(const float* q, const float* w, const float* keys, int64_t n, float* scores,
                      std::vector<float>& scratch) const {
  const int nI = config_.index_n_heads, d = kIndexDim;
  const bool prod = profile_ == Profile::kProduction;
  scratch.resize(size_t(nI) * size_t(n));
  sgemm_nt(nI, int(n), d, q, d, keys, d, scratch.data(),
              int(n));
  for (int64_t j = 0; j < n; ++j) {
    float sum = 0;
    for (int h = 0; h < nI; ++h) {
      float v = scratch[size_t(h) * size_t(n) + size_t(j)];
      // Production scores are bf16: each product and the head sum are rounded.
      if (prod) v = round_bf16(std::max(round_bf16(v), 0.0f) * w[h]);
      else v = std::max(v, 0.0f) * w[h];
      sum += v;
    }
    scores[j] = prod ? round_bf16(sum) : sum;
  }
}

namespace {

struct Candidate {
  float score;
  int32_t slot;
};
// A total order (ties to the lower slot), so streaming selection equals a full sort.
bool better(const Candidate& a, const Candidate& b) {
  return a.score > b.score || (a.score == b.score && a.slot < b.slot);
}

}  // namespace

std::vector<std::vector<int32_t>> IndexerOp::select(const StepView& s, const float* x, const float* cq,
                                                    const EntryArena& keys) const {
  const int T = s.dims.tokens, nI = config_.index_n_heads, d = kIndexDim, k = config_.index_topk;
  std::vector<float> q, w;
  queries(s, x, cq, q, w);
  std::vector<std::vector<int32_t>> picks(static_cast<size_t>(T));
  // Keys stream through in tiles decoded once per run, and each token keeps
  // only its k best so far: memory stays O(tile + T * k) at any context length.
  const int64_t kTile = key_tile_;
  std::vector<float> tile(size_t(kTile) * d);
  std::vector<std::vector<Candidate>> best(static_cast<size_t>(T));
  for (int r = 0; r < s.dims.runs; ++r) {
    const int64_t n = (s.positions[s.run_token_begin[r + 1] - 1] + 1) / 4;  // visible to the run's last token
    for (int64_t j0 = 0; j0 < n; j0 += kTile) {
      const int64_t j1 = std::min(n, j0 + kTile);
#pragma omp parallel for
      for (int64_t j = j0; j < j1; ++j)
        keys.read(block_table_slot(s.table(CacheGroup::kC4A), r, j), tile.data() + size_t(j - j0) * d);
#pragma omp parallel
      {
        std::vector<float> scores, scratch;
#pragma omp for schedule(dynamic)
        for (int t = s.run_token_begin[r]; t < s.run_token_begin[r + 1]; ++t) {
          const int64_t visible = std::min<int64_t>(j1, (s.positions[t] + 1) / 4);
          if (visible <= j0) continue;
          scores.resize(size_t(visible - j0));
          score(q.data() + size_t(t) * nI * d, w.data() + size_t(t) * nI, tile.data(), visible - j0, scores.data(),
                scratch);
          auto& b = best[size_t(t)];
          for (int64_t j = j0; j < visible; ++j) b.push_back({scores[size_t(j - j0)], int32_t(j)});
          if (int64_t(b.size()) > k) {
            std::nth_element(b.begin(), b.begin() + k, b.end(), better);
            b.resize(size_t(k));
          }
        }
      }
    }
  }
#pragma omp parallel for
  for (int t = 0; t < T; ++t) {
    auto& b = best[size_t(t)];
    std::sort(b.begin(), b.end(), better);
    for (const Candidate& c : b) picks[size_t(t)].push_back(c.slot);
  }
  return picks;
}

}  // namespace dsv4
