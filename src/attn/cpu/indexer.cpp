#include "attn/cpu/indexer.h"


#include <algorithm>
#include <cmath>
#include <numeric>
#include <string>

#include "attn/cpu/sgemm.h"
#include "common/error.h"
#include "numerics/bf16.h"

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

// ---- the layer's op ----------------------------------------------------------------

IndexerOp::IndexerOp(const IndexerWeights& w, const ModelConfig& config, Profile profile, bool cache_weights,
                     const Rope& rope, IndexKeyFormat key_format, int key_tile)
    : config_(config), profile_(profile), rope_(rope), key_format_(key_format), key_tile_(std::max(1, key_tile)),
      wq_b_(&w.wq_b, LinearMode::kFp8, cache_weights),
      weights_proj_(&w.weights_proj, LinearMode::kBf16, cache_weights) {}

std::vector<std::vector<int32_t>> IndexerOp::select(const StepView& s, const float* x, const float* cq,
                                                    const EntryArena& keys, CpuScratch& ws) const {
  if (profile_ == Profile::kProduction) return select_production(s, x, cq, keys, ws);
  return select_exact(s, x, cq, keys);
}

std::vector<std::vector<int32_t>> IndexerOp::select_production(const StepView& s, const float* x, const float* cq,
                                                               const EntryArena& keys, CpuScratch& ws) const {
  const int T = s.dims.tokens, nI = config_.index_n_heads, k = config_.index_topk;
  DSV4_REQUIRE(keys.pages.page_stride == index_key_page_stride(key_format_, keys.pages.entries_per_page),
               "indexer: production numerics need indexer key pages in the " +
                   std::string(index_key_format_name(key_format_)) + " format");
  // The linears (outputs rounded to bf16), then op 1.
  std::vector<float> q(size_t(T) * nI * kIndexDim), proj(size_t(T) * nI);
  wq_b_.forward(cq, T, q.data(), profile_, &ws.xq);
  weights_proj_.forward(x, T, proj.data(), profile_);
  std::vector<uint16_t> q_bits(q.size());
  for (size_t i = 0; i < q.size(); ++i) q_bits[i] = bf16_bits(q[i]);
  const int cb = indexer_code_bytes(key_format_);
  std::vector<uint8_t> codes(size_t(T) * nI * cb), scales(size_t(T) * nI * kIndexerScaleBytes);
  std::vector<float> weights(size_t(T) * nI);
  IndexerQueryParams qp;
  qp.num_tokens = T;
  qp.num_heads = nI;
  qp.q_raw = q_bits.data();
  qp.q_ld = int64_t(nI) * kIndexDim;
  qp.proj = proj.data();
  qp.proj_ld = nI;
  qp.positions = s.positions;
  qp.rope = rope_.freqs();
  qp.out = IndexerQueriesOut{key_format_, T, nI, codes.data(), scales.data(), weights.data()};
  indexer_queries_cpu(qp);

  // Op 2 on the step's C4A tables.
  std::vector<int32_t> picks(size_t(T) * k), slots(size_t(T) * k), lengths(static_cast<size_t>(T));
  IndexerSelectParams sp;
  sp.num_tokens = T;
  sp.positions = s.positions;
  sp.token_run = s.token_run;
  sp.c4a_table = s.table(CacheGroup::kC4A);
  sp.keys = keys.pages;
  sp.queries = IndexerQueries{key_format_, T, nI, codes.data(), scales.data(), weights.data()};
  sp.topk = k;
  sp.picks = picks.data();
  sp.slots = slots.data();
  sp.lengths = lengths.data();
  indexer_select_cpu(sp, key_tile_);
  std::vector<std::vector<int32_t>> out(static_cast<size_t>(T));
  for (int t = 0; t < T; ++t)
    out[size_t(t)].assign(picks.begin() + int64_t(t) * k, picks.begin() + int64_t(t) * k + lengths[size_t(t)]);
  return out;
}

// ---- exact profile: float32 queries and keys, no rounding ------------------------------

void IndexerOp::queries_exact(const StepView& s, const float* x, const float* cq, std::vector<float>& q,
                              std::vector<float>& w) const {
  const int T = s.dims.tokens, nI = config_.index_n_heads, d = kIndexDim;
  q.resize(size_t(T) * nI * d);
  w.resize(size_t(T) * nI);
  wq_b_.forward(cq, T, q.data(), profile_);
  weights_proj_.forward(x, T, w.data(), profile_);
  const float head_scale = indexer_head_scale(nI);
#pragma omp parallel for
  for (int t = 0; t < T; ++t) {
    for (int h = 0; h < nI; ++h) rope_.apply(q.data() + (size_t(t) * nI + h) * d + d - kRopeDim, s.positions[t]);
    for (int h = 0; h < nI; ++h) w[size_t(t) * nI + h] *= head_scale;
  }
}

void IndexerOp::score_exact(const float* q, const float* w, const float* keys, int64_t n, float* scores,
                            std::vector<float>& scratch) const {
  const int nI = config_.index_n_heads, d = kIndexDim;
  scratch.resize(size_t(nI) * size_t(n));
  sgemm_nt(nI, int(n), d, q, d, keys, d, scratch.data(), int(n));
  for (int64_t j = 0; j < n; ++j) {
    float sum = 0;
    for (int h = 0; h < nI; ++h) sum += std::max(scratch[size_t(h) * size_t(n) + size_t(j)], 0.0f) * w[h];
    scores[j] = sum;
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

std::vector<std::vector<int32_t>> IndexerOp::select_exact(const StepView& s, const float* x, const float* cq,
                                                          const EntryArena& keys) const {
  const int T = s.dims.tokens, nI = config_.index_n_heads, d = kIndexDim, k = config_.index_topk;
  std::vector<float> q, w;
  queries_exact(s, x, cq, q, w);
  std::vector<std::vector<int32_t>> picks(static_cast<size_t>(T));
  // Keys stream through in tiles decoded once per run, and each token keeps
  // only its k best so far: memory stays O(tile + T * k) at any context length.
  const int64_t kTile = key_tile_;
  std::vector<float> tile(size_t(kTile) * d);
  std::vector<std::vector<Candidate>> best(static_cast<size_t>(T));
  for (int r = 0; r < s.dims.runs; ++r) {
    const int64_t n = (s.positions[s.run_token_begin[r + 1] - 1] + 1) / 4;  // visible to the run's last token
    for (int64_t j0 = 0; j0 < n; j0 += kTile) {
      const int64_t j1 = std::min<int64_t>(n, j0 + kTile);
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
          score_exact(q.data() + size_t(t) * nI * d, w.data() + size_t(t) * nI, tile.data(), visible - j0,
                      scores.data(), scratch);
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
