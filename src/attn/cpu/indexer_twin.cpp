#include "attn/cpu/indexer_twin.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "common/error.h"
#include "numerics/bf16.h"
#include "numerics/hadamard.h"
#include "numerics/quant.h"
#include "numerics/rope.h"

namespace dsv4 {
namespace {

int real_tokens(int num_tokens, const int32_t* real) { return real ? std::clamp(*real, 0, num_tokens) : num_tokens; }

// ---- op 1: queries -----------------------------------------------------------------

// Rope::apply with the layer's frequencies passed in (the CUDA op gets them the same way).
void rope_rotate(float* x, int64_t pos, const RopeFreqs& f) {
  for (int i = 0; i < kRopeDim / 2; ++i) {
    const float angle = float(pos) * f.inv_freq[i];
    const float c = float(std::cos(double(angle))), s = float(std::sin(double(angle)));
    const float a = x[2 * i], b = x[2 * i + 1];
    x[2 * i] = a * c - b * s;
    x[2 * i + 1] = a * s + b * c;
  }
}

// One head: RoPE, bf16, Hadamard, bf16, then quantized into its record.
void quantize_head(const uint16_t* q_raw, int64_t pos, const RopeFreqs& rope, IndexKeyFormat f, uint8_t* codes,
                   uint8_t* scales) {
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

// ---- op 2: scores ------------------------------------------------------------------
// Dots in exact integer arithmetic, so the order of the products is free:
// MXFP4 codes as 2 * e2m1 (int16, per-block sums below 2^13), FP8 codes as
// 512 * e4m3 (int32, products below 2^36, sums below 2^43 in int64).

uint8_t nibble(const uint8_t* d, int i) { return (i % 2 == 0) ? (d[i / 2] & 0xf) : (d[i / 2] >> 4); }

void unpack_record(IndexKeyFormat f, const uint8_t* d, int16_t* mx, int32_t* f8, bool& nan) {
  nan = false;
  for (int i = 0; i < kIndexDim; ++i) {
    if (f == IndexKeyFormat::kMxfp4) {
      mx[i] = int16_t(indexer_e2m1_twice(nibble(d, i)));
    } else {
      nan = nan || indexer_e4m3_is_nan(d[i]);
      f8[i] = indexer_e4m3_times512(d[i]);
    }
  }
}

int block_dot(const int16_t* a, const int16_t* b) {
  int s = 0;
  for (int i = 0; i < 32; ++i) s += int(a[i]) * int(b[i]);
  return s;
}

int64_t fp8_sum(const int32_t* a, const int32_t* b) {
  int64_t s = 0;
  for (int i = 0; i < kIndexDim; ++i) s += int64_t(a[i]) * int64_t(b[i]);
  return s;
}

// Keys [j0, j0 + n) of a run, unpacked; absent keys (no page) are flagged.
struct KeyTile {
  IndexKeyFormat format = IndexKeyFormat::kMxfp4;
  int n = 0;
  std::vector<uint8_t> present, nan;
  std::vector<const uint8_t*> scales;  // the record's 4 scale bytes
  std::vector<int16_t> mx;             // [n][128]
  std::vector<int32_t> f8;             // [n][128]
};

const uint8_t* record(const KvPages& keys, IndexKeyFormat f, int32_t slot, bool scale_part) {
  const int64_t per = keys.entries_per_page, cb = indexer_code_bytes(f);
  const uint8_t* page = keys.page(slot / per);
  return scale_part ? page + size_t(cb * per) + size_t(kIndexerScaleBytes) * size_t(slot % per)
                    : page + size_t(cb) * size_t(slot % per);
}

void load_tile(KeyTile& k, IndexKeyFormat f, const BlockTableView& table, int run, const KvPages& keys, int64_t j0,
               int n) {
  k.format = f;
  k.n = n;
  k.present.assign(size_t(n), 0);
  k.nan.assign(size_t(n), 0);
  k.scales.assign(size_t(n), nullptr);
  if (f == IndexKeyFormat::kMxfp4) k.mx.assign(size_t(n) * kIndexDim, 0);
  else k.f8.assign(size_t(n) * kIndexDim, 0);
#pragma omp parallel for
  for (int jj = 0; jj < n; ++jj) {
    const int32_t slot = block_table_slot(table, run, j0 + jj);
    if (slot < 0 || int64_t(slot) >= keys.capacity()) continue;
    bool nan = false;
    const bool mx = f == IndexKeyFormat::kMxfp4;
    unpack_record(f, record(keys, f, slot, false), mx ? k.mx.data() + size_t(jj) * kIndexDim : nullptr,
                  mx ? nullptr : k.f8.data() + size_t(jj) * kIndexDim, nan);
    k.present[size_t(jj)] = 1;
    k.nan[size_t(jj)] = nan;
    k.scales[size_t(jj)] = record(keys, f, slot, true);
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
    const bool mx = q_.format == IndexKeyFormat::kMxfp4;
    qmx_.resize(mx ? size_t(nI) * kIndexDim : 0);
    qf8_.resize(mx ? 0 : size_t(nI) * kIndexDim);
    qnan_.assign(size_t(nI), 0);
    for (int h = 0; h < nI; ++h) {
      bool nan = false;
      unpack_record(q_.format, q_.codes + (e0 + size_t(h)) * size_t(cb), mx ? qmx_.data() + size_t(h) * kIndexDim : nullptr,
                    mx ? nullptr : qf8_.data() + size_t(h) * kIndexDim, nan);
      qnan_[size_t(h)] = nan;
    }
    for (int jj = 0; jj < m; ++jj) {
      if (!k.present[size_t(jj)]) {
        scores[jj] = std::numeric_limits<float>::quiet_NaN();
        continue;
      }
      IndexerHeadSum hs;
      for (int h = 0; h < nI; ++h) {
        const uint8_t* qs = q_.scales + (e0 + size_t(h)) * kIndexerScaleBytes;
        float v;
        if (mx) {
          int s[4];
          for (int b = 0; b < 4; ++b)
            s[b] = block_dot(qmx_.data() + size_t(h) * kIndexDim + 32 * b, k.mx.data() + size_t(jj) * kIndexDim + 32 * b);
          v = indexer_mxfp4_combine(s, qs, k.scales[size_t(jj)]);
        } else {
          v = (qnan_[size_t(h)] || k.nan[size_t(jj)])
                  ? std::numeric_limits<float>::quiet_NaN()
                  : indexer_fp8_scale(double(fp8_sum(qf8_.data() + size_t(h) * kIndexDim,
                                                     k.f8.data() + size_t(jj) * kIndexDim)),
                                      scale_f32(qs), scale_f32(k.scales[size_t(jj)]));
        }
        hs.add(h, indexer_term(v, q_.weights[e0 + size_t(h)]));
      }
      scores[jj] = indexer_finish(hs.total());
    }
  }

 private:
  const IndexerQueries& q_;
  std::vector<int16_t> qmx_;
  std::vector<int32_t> qf8_;
  std::vector<uint8_t> qnan_;
};

}  // namespace

void check_indexer_query_params(const IndexerQueryParams& p) {
  DSV4_REQUIRE(p.num_tokens >= 0, "indexer queries: negative token count");
  if (p.num_tokens == 0) return;
  DSV4_REQUIRE(p.num_heads > 0, "indexer queries: num_heads must be positive");
  DSV4_REQUIRE(p.q_raw && p.proj && p.positions, "indexer queries: q_raw, proj and positions are required");
  DSV4_REQUIRE(p.q_ld >= int64_t(kIndexDim) * p.num_heads, "indexer queries: q_ld smaller than num_heads * 128");
  DSV4_REQUIRE(p.proj_ld >= p.num_heads, "indexer queries: proj_ld smaller than num_heads");
  DSV4_REQUIRE(p.out.codes && p.out.scales && p.out.weights, "indexer queries: output codes, scales and weights are required");
  DSV4_REQUIRE(p.out.num_tokens == p.num_tokens && p.out.num_heads == p.num_heads,
          "indexer queries: output sizes differ from the params");
}

void indexer_queries_cpu(const IndexerQueryParams& p) {
  check_indexer_query_params(p);
  const int T = real_tokens(p.num_tokens, p.real_tokens), nI = p.num_heads;
  const IndexKeyFormat f = p.out.format;
  const int cb = indexer_code_bytes(f);
  const float head_scale = indexer_head_scale(p.weight_heads());
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

void check_indexer_select_params(const IndexerSelectParams& p) {
  DSV4_REQUIRE(p.num_tokens >= 0, "indexer select: negative token count");
  if (p.num_tokens == 0) return;
  DSV4_REQUIRE(p.positions && p.token_run, "indexer select: positions and token_run are required");
  DSV4_REQUIRE(p.topk >= 1 && p.topk <= kIndexerMaxTopk,
          "indexer select: topk must be in [1, " + std::to_string(kIndexerMaxTopk) + "]");
  DSV4_REQUIRE(p.picks && p.slots && p.lengths, "indexer select: picks, slots and lengths are required");
  DSV4_REQUIRE(p.queries.codes && p.queries.scales && p.queries.weights, "indexer select: queries are required");
  DSV4_REQUIRE(p.queries.num_tokens == p.num_tokens, "indexer select: queries hold a different token count");
  DSV4_REQUIRE(p.queries.num_heads > 0, "indexer select: queries without heads");
  DSV4_REQUIRE(p.c4a_table.pages && p.c4a_table.first && p.c4a_table.width >= 0,
          "indexer select: the C4A block table is required");
  DSV4_REQUIRE(p.c4a_table.entries_per_page == kIndexerKeysPerPage, "indexer select: the C4A table must have 64 entries per page");
  DSV4_REQUIRE(p.keys.entries_per_page == kIndexerKeysPerPage, "indexer select: key pages must hold 64 entries");
  DSV4_REQUIRE(p.keys.num_pages == 0 || p.keys.base, "indexer select: key pages without a base");
  DSV4_REQUIRE(p.keys.num_pages == 0 ||
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
  std::vector<int32_t> run_ids;
  std::vector<std::vector<int>> run_tokens;
  for (int t = 0; t < real; ++t) {
    const auto it = std::find(run_ids.begin(), run_ids.end(), p.token_run[t]);
    if (it == run_ids.end()) {
      run_ids.push_back(p.token_run[t]);
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

}  // namespace dsv4
