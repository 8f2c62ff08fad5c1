#include "attn/cpu/indexer.h"

#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <numeric>
#include <string>

#include "common/error.h"
#include "numerics/bf16.h"
#include "numerics/e2m1.h"
#include "numerics/e4m3.h"
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

// ---- op 1: queries -----------------------------------------------------------------

namespace {

int real_tokens(int num_tokens, const int32_t* real) {
  return real ? std::clamp(*real, 0, num_tokens) : num_tokens;
}

// Rope::apply with the layer's frequencies passed in (the CUDA op gets them the same way).
void rope_rotate(float* x, int64_t pos, const IndexerRopeFreqs& f) {
  for (int i = 0; i < kRopeDim / 2; ++i) {
    const float angle = float(pos) * f.inv_freq[i];
    const float c = float(std::cos(double(angle))), s = float(std::sin(double(angle)));
    const float a = x[2 * i], b = x[2 * i + 1];
    x[2 * i] = a * c - b * s;
    x[2 * i + 1] = a * s + b * c;
  }
}

// One head: RoPE, bf16, Hadamard, bf16, then quantized into its record.
void quantize_head(const uint16_t* q_raw, int64_t pos, const IndexerRopeFreqs& rope, IndexKeyFormat f,
                   uint8_t* codes, uint8_t* scales) {
  float x[kIndexDim];
  for (int i = 0; i < kIndexDim; ++i) x[i] = bf16_to_float(q_raw[i]);
  rope_rotate(x + kIndexDim - kRopeDim, pos, rope);
  round_bf16(x + kIndexDim - kRopeDim, kRopeDim);
  hadamard_rotate(x, kIndexDim);
  round_bf16(x, kIndexDim);
  if (f == IndexKeyFormat::kFp8) {
    const float scale = exp2_int(quantize_e4m3_block(x, kIndexDim, codes));
    std::memcpy(scales, &scale, 4);
    return;
  }
  uint8_t c[kIndexDim];
  for (int b = 0; b < kIndexDim / kFp4QuantBlock; ++b)
    scales[b] = ue8m0_from_exponent(quantize_e2m1_block(x + kFp4QuantBlock * b, kFp4QuantBlock, c + kFp4QuantBlock * b));
  for (int i = 0; i < kIndexDim / 2; ++i) codes[i] = uint8_t(c[2 * i] | (c[2 * i + 1] << 4));
}

}  // namespace

void check_indexer_query_params(const IndexerQueryParams& p) {
  require(p.num_tokens >= 0, "indexer queries: negative token count");
  if (p.num_tokens == 0) return;
  require(p.num_heads > 0, "indexer queries: num_heads must be positive");
  require(p.q_raw && p.proj && p.positions, "indexer queries: q_raw, proj and positions are required");
  require(p.q_ld >= int64_t(kIndexDim) * p.num_heads, "indexer queries: q_ld smaller than num_heads * 128");
  require(p.proj_ld >= p.num_heads, "indexer queries: proj_ld smaller than num_heads");
  require(p.out.codes && p.out.scales && p.out.weights, "indexer queries: output codes, scales and weights are required");
  require(p.out.num_tokens == p.num_tokens && p.out.num_heads == p.num_heads,
          "indexer queries: output sizes differ from the params");
}

void indexer_queries_cpu(const IndexerQueryParams& p) {
  check_indexer_query_params(p);
  const int T = real_tokens(p.num_tokens, p.real_tokens), nI = p.num_heads;
  const IndexKeyFormat f = p.out.format;
  const int cb = indexer_code_bytes(f);
  const float head_scale = indexer_head_scale(nI);
#pragma omp parallel for
  for (int t = 0; t < T; ++t) {
    for (int h = 0; h < nI; ++h) {
      const size_t e = size_t(t) * size_t(nI) + size_t(h);
      quantize_head(p.q_raw + t * p.q_ld + int64_t(kIndexDim) * h, p.positions[t], p.rope, f, p.out.codes + e * cb,
                    p.out.scales + e * kIndexerScaleBytes);
      p.out.weights[e] = round_bf16(round_bf16(p.proj[t * p.proj_ld + h]) * head_scale);
    }
  }
}

// ---- op 2: scores and selection -------------------------------------------------------

namespace {

// One tile of keys [j0, j0 + n) of a run, unpacked for BLAS: MXFP4 e2m1
// values per 32-block ([4][n][32] floats), FP8 codes times 512 ([n][128]
// doubles); both exact, so any summation order gives the exact dot.
struct KeyTile {
  IndexKeyFormat format;
  int64_t j0 = 0;
  int n = 0;
  std::vector<uint8_t> present;
  std::vector<const uint8_t*> scales;  // the record's 4 scale bytes
  std::vector<uint8_t> nan;            // FP8: a NaN code in the record
  std::vector<float> blocks;           // MXFP4
  std::vector<double> codes;           // FP8
};

const uint8_t* record_data(const KvPages& keys, IndexKeyFormat f, int32_t slot) {
  const int64_t per = keys.entries_per_page;
  return keys.page(slot / per) + size_t(indexer_code_bytes(f)) * size_t(slot % per);
}
const uint8_t* record_scales(const KvPages& keys, IndexKeyFormat f, int32_t slot) {
  const int64_t per = keys.entries_per_page;
  return keys.page(slot / per) + size_t(indexer_code_bytes(f)) * size_t(per) + size_t(kIndexerScaleBytes) * size_t(slot % per);
}

void load_tile(KeyTile& k, IndexKeyFormat f, const BlockTableView& table, int run, const KvPages& keys, int64_t j0,
               int n) {
  k.format = f;
  k.j0 = j0;
  k.n = n;
  k.present.assign(size_t(n), 0);
  k.scales.assign(size_t(n), nullptr);
  k.nan.assign(size_t(n), 0);
  if (f == IndexKeyFormat::kMxfp4) k.blocks.assign(size_t(n) * kIndexDim, 0.0f);
  else k.codes.assign(size_t(n) * kIndexDim, 0.0);
#pragma omp parallel for
  for (int jj = 0; jj < n; ++jj) {
    const int32_t slot = block_table_slot(table, run, j0 + jj);
    if (slot < 0 || int64_t(slot) >= keys.capacity()) continue;
    k.present[size_t(jj)] = 1;
    const uint8_t* d = record_data(keys, f, slot);
    k.scales[size_t(jj)] = record_scales(keys, f, slot);
    if (f == IndexKeyFormat::kMxfp4) {
      for (int i = 0; i < kIndexDim; ++i) {
        const uint8_t code = (i % 2 == 0) ? (d[i / 2] & 0xf) : (d[i / 2] >> 4);
        // block b = i / 32 of key jj at [b][jj][i % 32]
        k.blocks[(size_t(i / 32) * size_t(n) + size_t(jj)) * 32 + size_t(i % 32)] = e2m1_to_float(code);
      }
    } else {
      bool nan = false;
      for (int i = 0; i < kIndexDim; ++i) {
        nan = nan || indexer_e4m3_is_nan(d[i]);
        k.codes[size_t(jj) * kIndexDim + size_t(i)] = double(indexer_e4m3_times512(d[i]));
      }
      k.nan[size_t(jj)] = nan;
    }
  }
}

float scale_f32(const uint8_t* s) {
  float v;
  std::memcpy(&v, s, 4);
  return v;
}

// Scores of the first m keys of a tile for token t (NaN for absent keys).
class TokenScorer {
 public:
  explicit TokenScorer(const IndexerQueries& q) : q_(q) {}

  void score(int t, const KeyTile& k, int m, float* scores) {
    const int nI = q_.num_heads, cb = indexer_code_bytes(q_.format);
    const size_t e0 = size_t(t) * size_t(nI);
    if (q_.format == IndexKeyFormat::kMxfp4) {
      qf_.resize(size_t(nI) * kIndexDim);
      for (int h = 0; h < nI; ++h) {
        const uint8_t* d = q_.codes + (e0 + size_t(h)) * size_t(cb);
        for (int i = 0; i < kIndexDim; ++i) {
          const uint8_t code = (i % 2 == 0) ? (d[i / 2] & 0xf) : (d[i / 2] >> 4);
          qf_[(size_t(i / 32) * size_t(nI) + size_t(h)) * 32 + size_t(i % 32)] = e2m1_to_float(code);
        }
      }
      dot_.resize(size_t(4) * size_t(nI) * size_t(m));
      // Block sums of e2m1 products: multiples of 1/4 below 2^11, exact in float.
      for (int b = 0; b < 4; ++b)
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, nI, m, 32, 1.0f, qf_.data() + size_t(b) * nI * 32, 32,
                    k.blocks.data() + size_t(b) * k.n * 32, 32, 0.0f, dot_.data() + size_t(b) * nI * m, m);
      for (int jj = 0; jj < m; ++jj) {
        if (!k.present[size_t(jj)]) {
          scores[jj] = std::numeric_limits<float>::quiet_NaN();
          continue;
        }
        IndexerHeadSum hs;
        for (int h = 0; h < nI; ++h) {
          int s[4];
          for (int b = 0; b < 4; ++b) s[b] = int(4.0f * dot_[(size_t(b) * nI + size_t(h)) * size_t(m) + size_t(jj)]);
          const float v = indexer_mxfp4_combine(s, q_.scales + (e0 + size_t(h)) * kIndexerScaleBytes, k.scales[size_t(jj)]);
          hs.add(h, indexer_term(v, q_.weights[e0 + size_t(h)]));
        }
        scores[jj] = indexer_finish(hs.total());
      }
      return;
    }
    qd_.resize(size_t(nI) * kIndexDim);
    qnan_.assign(size_t(nI), 0);
    for (int h = 0; h < nI; ++h) {
      const uint8_t* d = q_.codes + (e0 + size_t(h)) * size_t(cb);
      for (int i = 0; i < kIndexDim; ++i) {
        qnan_[size_t(h)] = qnan_[size_t(h)] || indexer_e4m3_is_nan(d[i]);
        qd_[size_t(h) * kIndexDim + size_t(i)] = double(indexer_e4m3_times512(d[i]));
      }
    }
    dotd_.resize(size_t(nI) * size_t(m));
    // Integer products below 2^36, sums below 2^43: exact in double.
    cblas_dgemm(CblasRowMajor, CblasNoTrans, CblasTrans, nI, m, kIndexDim, 1.0, qd_.data(), kIndexDim,
                k.codes.data(), kIndexDim, 0.0, dotd_.data(), m);
    for (int jj = 0; jj < m; ++jj) {
      if (!k.present[size_t(jj)]) {
        scores[jj] = std::numeric_limits<float>::quiet_NaN();
        continue;
      }
      const float ks = scale_f32(k.scales[size_t(jj)]);
      IndexerHeadSum hs;
      for (int h = 0; h < nI; ++h) {
        const float qs = scale_f32(q_.scales + (e0 + size_t(h)) * kIndexerScaleBytes);
        const float v = (qnan_[size_t(h)] || k.nan[size_t(jj)])
                            ? std::numeric_limits<float>::quiet_NaN()
                            : indexer_fp8_scale(dotd_[size_t(h) * size_t(m) + size_t(jj)], qs, ks);
        hs.add(h, indexer_term(v, q_.weights[e0 + size_t(h)]));
      }
      scores[jj] = indexer_finish(hs.total());
    }
  }

 private:
  const IndexerQueries& q_;
  std::vector<float> qf_, dot_;
  std::vector<double> qd_, dotd_;
  std::vector<uint8_t> qnan_;
};

}  // namespace

void check_indexer_select_params(const IndexerSelectParams& p) {
  require(p.num_tokens >= 0, "indexer select: negative token count");
  if (p.num_tokens == 0) return;
  require(p.positions && p.token_run, "indexer select: positions and token_run are required");
  require(p.topk >= 1 && p.topk <= kIndexerMaxTopk,
          "indexer select: topk must be in [1, " + std::to_string(kIndexerMaxTopk) + "]");
  require(p.picks && p.slots && p.lengths, "indexer select: picks, slots and lengths are required");
  require(p.queries.codes && p.queries.scales && p.queries.weights, "indexer select: queries are required");
  require(p.queries.num_tokens == p.num_tokens, "indexer select: queries hold a different token count");
  require(p.queries.num_heads > 0, "indexer select: queries without heads");
  require(p.c4a_table.pages && p.c4a_table.first && p.c4a_table.width >= 0,
          "indexer select: the C4A block table is required");
  require(p.c4a_table.entries_per_page == kIndexerKeysPerPage, "indexer select: the C4A table must have 64 entries per page");
  require(p.keys.entries_per_page == kIndexerKeysPerPage, "indexer select: key pages must hold 64 entries");
  require(p.keys.num_pages == 0 || p.keys.base, "indexer select: key pages without a base");
  require(p.keys.num_pages == 0 ||
              p.keys.page_stride >= index_key_page_stride(p.queries.format, kIndexerKeysPerPage),
          "indexer select: key page stride smaller than a page of the key format");
}

void indexer_scores_cpu(const IndexerQueries& q, int t, const BlockTableView& table, int run, const KvPages& keys,
                        int64_t n, float* scores) {
  constexpr int kTile = 2048;
  KeyTile k;
  TokenScorer scorer(q);
  for (int64_t j0 = 0; j0 < n; j0 += kTile) {
    const int m = int(std::min<int64_t>(kTile, n - j0));
    load_tile(k, q.format, table, run, keys, j0, m);
    scorer.score(t, k, m, scores + j0);
  }
}

void indexer_select_cpu(const IndexerSelectParams& p, int key_tile) {
  check_indexer_select_params(p);
  const int T = p.num_tokens, real = real_tokens(T, p.real_tokens), k = p.topk;
  const int64_t tile = std::max(1, key_tile);
  // Tokens of each run (a run's tokens share its keys).
  std::vector<std::vector<int>> run_tokens;
  std::vector<int32_t> run_ids;
  for (int t = 0; t < real; ++t) {
    const int32_t r = p.token_run[t];
    const auto it = std::find(run_ids.begin(), run_ids.end(), r);
    if (it == run_ids.end()) {
      run_ids.push_back(r);
      run_tokens.push_back({t});
    } else {
      run_tokens[size_t(it - run_ids.begin())].push_back(t);
    }
  }
  std::vector<std::vector<uint64_t>> best(static_cast<size_t>(T));
  KeyTile keys;
  for (size_t ri = 0; ri < run_ids.size(); ++ri) {
    const std::vector<int>& toks = run_tokens[ri];
    int64_t n = 0;
    for (int t : toks) n = std::max(n, indexer_visible(p.positions[t]));
    for (int64_t j0 = 0; j0 < n; j0 += tile) {
      const int m = int(std::min(tile, n - j0));
      load_tile(keys, p.queries.format, p.c4a_table, run_ids[ri], p.keys, j0, m);
#pragma omp parallel
      {
        TokenScorer scorer(p.queries);
        std::vector<float> scores;
#pragma omp for schedule(dynamic)
        for (size_t i = 0; i < toks.size(); ++i) {
          const int t = toks[i];
          const int64_t visible = indexer_visible(p.positions[t]);
          if (visible <= j0) continue;
          const int mt = int(std::min<int64_t>(m, visible - j0));
          scores.resize(size_t(mt));
          scorer.score(t, keys, mt, scores.data());
          auto& b = best[size_t(t)];
          for (int jj = 0; jj < mt; ++jj)
            if (keys.present[size_t(jj)]) b.push_back(indexer_order_key(scores[size_t(jj)], j0 + jj));
          if (int64_t(b.size()) > k) {
            std::nth_element(b.begin(), b.begin() + k, b.end(), std::greater<uint64_t>());
            b.resize(size_t(k));
          }
        }
      }
    }
  }
#pragma omp parallel for
  for (int t = 0; t < T; ++t) {
    auto& b = best[size_t(t)];
    std::sort(b.begin(), b.end(), std::greater<uint64_t>());
    int32_t* picks = p.picks + int64_t(t) * k;
    int32_t* slots = p.slots + int64_t(t) * k;
    const int r = t < real ? p.token_run[t] : 0;
    for (int i = 0; i < k; ++i) {
      const bool has = size_t(i) < b.size();
      picks[i] = has ? indexer_key_index(b[size_t(i)]) : -1;
      slots[i] = has ? block_table_slot(p.c4a_table, r, picks[i]) : -1;
    }
    p.lengths[t] = int32_t(b.size());
  }
}

// ---- the layer's op ----------------------------------------------------------------

IndexerOp::IndexerOp(const IndexerWeights& w, const ModelConfig& config, Profile profile, bool cache_weights,
                     const Rope& rope, IndexKeyFormat key_format, int key_tile)
    : config_(config), profile_(profile), rope_(rope), key_format_(key_format), key_tile_(std::max(1, key_tile)),
      wq_b_(&w.wq_b, LinearMode::kFp8, cache_weights),
      weights_proj_(&w.weights_proj, LinearMode::kBf16, cache_weights) {}

std::vector<std::vector<int32_t>> IndexerOp::select(const StepMetadata& s, const float* x, const float* cq,
                                                    const PageStore& keys) const {
  if (profile_ == Profile::kProduction) return select_production(s, x, cq, keys);
  return select_exact(s, x, cq, keys);
}

std::vector<std::vector<int32_t>> IndexerOp::select_production(const StepMetadata& s, const float* x, const float* cq,
                                                               const PageStore& keys) const {
  const int T = s.num_tokens(), nI = config_.index_n_heads, k = config_.index_topk;
  require(keys.page_stride() == index_key_page_stride(key_format_, keys.entries_per_page()),
          "indexer: production numerics need indexer key pages in the " +
              std::string(index_key_format_name(key_format_)) + " format");
  // The linears (outputs rounded to bf16), then op 1.
  std::vector<float> q(size_t(T) * nI * kIndexDim), proj(size_t(T) * nI);
  wq_b_.forward(cq, T, q.data(), profile_);
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
  qp.positions = s.positions.data();
  std::copy(rope_.inv_freq().begin(), rope_.inv_freq().end(), qp.rope.inv_freq);
  qp.out = IndexerQueriesOut{key_format_, T, nI, codes.data(), scales.data(), weights.data()};
  indexer_queries_cpu(qp);

  // Op 2 on the step's tables, flattened.
  int width = 1;
  for (const auto& row : s.c4a_table) width = std::max(width, int(row.size()));
  std::vector<int32_t> pages(s.c4a_table.size() * size_t(width), -1), first(s.c4a_table.size(), 0);
  for (size_t r = 0; r < s.c4a_table.size(); ++r)
    std::copy(s.c4a_table[r].begin(), s.c4a_table[r].end(), pages.begin() + int64_t(r) * width);
  std::vector<int32_t> picks(size_t(T) * k), slots(size_t(T) * k), lengths(static_cast<size_t>(T));
  IndexerSelectParams sp;
  sp.num_tokens = T;
  sp.positions = s.positions.data();
  sp.token_run = s.token_run.data();
  sp.c4a_table = BlockTableView{pages.data(), first.data(), width, kIndexerKeysPerPage};
  sp.keys = KvPages{keys.data(), keys.num_pages(), keys.entries_per_page(), keys.page_stride()};
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

void IndexerOp::queries_exact(const StepMetadata& s, const float* x, const float* cq, std::vector<float>& q,
                              std::vector<float>& w) const {
  const int T = s.num_tokens(), nI = config_.index_n_heads, d = kIndexDim;
  q.resize(size_t(T) * nI * d);
  w.resize(size_t(T) * nI);
  wq_b_.forward(cq, T, q.data(), profile_);
  weights_proj_.forward(x, T, w.data(), profile_);
  const float head_scale = indexer_head_scale(nI);
#pragma omp parallel for
  for (int t = 0; t < T; ++t) {
    for (int h = 0; h < nI; ++h) rope_.apply(q.data() + (size_t(t) * nI + h) * d + d - kRopeDim, s.positions[size_t(t)]);
    for (int h = 0; h < nI; ++h) w[size_t(t) * nI + h] *= head_scale;
  }
}

void IndexerOp::score_exact(const float* q, const float* w, const float* keys, int64_t n, float* scores,
                            std::vector<float>& scratch) const {
  const int nI = config_.index_n_heads, d = kIndexDim;
  scratch.resize(size_t(nI) * size_t(n));
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, nI, int(n), d, 1.0f, q, d, keys, d, 0.0f, scratch.data(),
              int(n));
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

std::vector<std::vector<int32_t>> IndexerOp::select_exact(const StepMetadata& s, const float* x, const float* cq,
                                                          const PageStore& keys) const {
  const int T = s.num_tokens(), nI = config_.index_n_heads, d = kIndexDim, k = config_.index_topk;
  std::vector<float> q, w;
  queries_exact(s, x, cq, q, w);
  std::vector<std::vector<int32_t>> picks(static_cast<size_t>(T));
  // Keys stream through in tiles decoded once per run, and each token keeps
  // only its k best so far: memory stays O(tile + T * k) at any context length.
  const int64_t kTile = key_tile_;
  std::vector<float> tile(size_t(kTile) * d);
  std::vector<std::vector<Candidate>> best(static_cast<size_t>(T));
  for (size_t r = 0; r < s.runs.size(); ++r) {
    const int64_t n = (s.positions[size_t(s.token_begin[r + 1] - 1)] + 1) / 4;  // visible to the run's last token
    for (int64_t j0 = 0; j0 < n; j0 += kTile) {
      const int64_t j1 = std::min(n, j0 + kTile);
#pragma omp parallel for
      for (int64_t j = j0; j < j1; ++j)
        keys.read(StepMetadata::map_slot(s.c4a_table[r], CacheGroup::kC4A, j), tile.data() + size_t(j - j0) * d);
#pragma omp parallel
      {
        std::vector<float> scores, scratch;
#pragma omp for schedule(dynamic)
        for (int t = s.token_begin[r]; t < s.token_begin[r + 1]; ++t) {
          const int64_t visible = std::min(j1, (s.positions[size_t(t)] + 1) / 4);
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
