#pragma once
// The lightning indexer of SPEC §4.4 with the production numerics of SPEC §5,
// as one backend-neutral contract: the flat inputs and outputs of its two ops
// and the scalar arithmetic both backends run, so that the CPU twin
// (attn/cpu/indexer_twin.h) and the CUDA ops (attn/cuda/indexer_*_cuda.h) produce
// the same bits.
//
// Op 1, queries: q_raw (bf16, the indexer wq_b output) and the weights_proj
// output -> per (token, head) a quantized query record in the key-entry
// format of SPEC §6 (MXFP4: 64 bytes of packed e2m1 + 4 UE8M0 bytes; FP8: 128
// e4m3 bytes + one fp32 power-of-two scale) and a head weight. Per head:
// RoPE on dims 64..127 (Rope::apply), bf16; Hadamard rotation, bf16; block
// quantization as the keys are. w = bf16(bf16(proj) * 128^-1/2 * nI^-1/2).
//
// Op 2, selection: for token t at position p of run r, key j is visible when
// j < (p + 1) / 4 and it has a page (block_table_slot(c4a_table, r, j) >= 0,
// inside the key cache). Its score is
//   score(t, j) = bf16( sum_h bf16( relu(bf16(dot_h)) * w[t, h] ) )
// where dot_h is the dot product of the dequantized query and key, rounded
// once to fp32 (indexer_mxfp4_dot / indexer_fp8_dot below: exact integer
// arithmetic, so the order of the products does not matter), and the head
// sum runs in the fixed order of IndexerHeadSum. The k = min(topk, visible
// keys) best keys by the total order of indexer_order_key (higher score
// first, ties to the lower j) are the picks, listed best first.
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>

#include "cache/block_table.h"
#include "cache/index_key_format.h"
#include "cache/pages.h"
#include "common/hd.h"
#include "numerics/bf16.h"
#include "numerics/quant.h"
#include "numerics/rope.h"

namespace dsv4 {

inline constexpr int kIndexerKeysPerPage = 64;  // indexer key pages and C4A tables (SPEC §6)
// Positions stay below max_position_embeddings = 2^20, so j < 2^18: the
// order key keeps 18 bits of j. Visible counts are clamped to this.
inline constexpr int64_t kIndexerMaxKeys = int64_t(1) << 18;
inline constexpr int kIndexerMaxTopk = 1024;

// Bytes of the data part of one record (query or key); the scale part is 4 bytes.
constexpr int indexer_code_bytes(IndexKeyFormat f) { return f == IndexKeyFormat::kFp8 ? kIndexDim : kIndexDim / 2; }
inline constexpr int kIndexerScaleBytes = 4;

// Quantized queries: record e = t * num_heads + h at codes + e * code_bytes,
// its scale bytes at scales + 4 * e; weights[e] holds a bf16 value.
struct IndexerQueries {
  IndexKeyFormat format = IndexKeyFormat::kMxfp4;
  int num_tokens = 0, num_heads = 0;
  const uint8_t* codes = nullptr;
  const uint8_t* scales = nullptr;
  const float* weights = nullptr;
};

struct IndexerQueriesOut {
  IndexKeyFormat format = IndexKeyFormat::kMxfp4;
  int num_tokens = 0, num_heads = 0;
  uint8_t* codes = nullptr;
  uint8_t* scales = nullptr;
  float* weights = nullptr;
  operator IndexerQueries() const { return IndexerQueries{format, num_tokens, num_heads, codes, scales, weights}; }
};

struct IndexerQueryParams {
  int num_tokens = 0, num_heads = 0;
  // The model's indexer heads nI, for the head weights' nI^-1/2 (0: num_heads).
  // A model with fewer than the GPU scorer's 64 heads runs with num_heads = 64
  // on zero-padded q_raw and proj columns: the padded heads' terms are +0 and
  // leave every score as the model's nI heads give it.
  int scale_heads = 0;
  constexpr int weight_heads() const { return scale_heads > 0 ? scale_heads : num_heads; }
  // Tokens t >= *real_tokens are padding: nothing is read or written for
  // them. Null: every token is real.
  const int32_t* real_tokens = nullptr;
  const uint16_t* q_raw = nullptr;  // bf16 bits; head h of token t at q_raw + t * q_ld + 128 * h
  int64_t q_ld = 0;                 // elements; >= 128 * num_heads
  const float* proj = nullptr;      // weights_proj output, fp32: proj[t * proj_ld + h]
  int64_t proj_ld = 0;              // elements; >= num_heads
  const int32_t* positions = nullptr;  // [num_tokens]
  RopeFreqs rope;  // the layer's (Rope::freqs())
  IndexerQueriesOut out;  // format and sizes must match the params
};

struct IndexerSelectParams {
  int num_tokens = 0;
  const int32_t* real_tokens = nullptr;  // as in IndexerQueryParams
  const int32_t* positions = nullptr;    // [num_tokens]
  const int32_t* token_run = nullptr;    // [num_tokens]: row of c4a_table
  BlockTableView c4a_table;              // entries_per_page 64
  KvPages keys;                          // indexer key pages, entries_per_page 64
  IndexerQueries queries;
  int topk = 0;                          // 1 .. kIndexerMaxTopk
  int32_t* picks = nullptr;    // [num_tokens, topk] request-local j, best first, -1 padded
  int32_t* slots = nullptr;    // [num_tokens, topk] block_table_slot(c4a_table, r, j), -1 padded
  int32_t* lengths = nullptr;  // [num_tokens] picks per token
};

// Shapes and pointers of the ops' params, shared by both backends (defined
// in attn/cpu/indexer_twin.cpp); throw Error naming the problem.
void check_indexer_query_params(const IndexerQueryParams& p);
void check_indexer_select_params(const IndexerSelectParams& p);

// ---- scalar arithmetic shared by the backends --------------------------------

// 1 / sqrt(128) as numerics/hadamard.cpp scales, and the head-weight factor
// 128^-1/2 * nI^-1/2 as the CPU indexer computes it.
inline float indexer_hadamard_scale() { return float(1.0 / std::sqrt(double(kIndexDim))); }
inline float indexer_head_scale(int num_heads) {
  return float(1.0 / std::sqrt(double(kIndexDim)) / std::sqrt(double(num_heads)));
}

// Visible keys of a query at position pos.
constexpr int64_t indexer_visible(int64_t pos) {
  const int64_t n = pos < 0 ? 0 : (pos + 1) / 4;
  return n < kIndexerMaxKeys ? n : kIndexerMaxKeys;
}

// Twice an e2m1 value (an integer in [-12, 12]) from its 4-bit code. The
// magnitudes 0, 1, 2, 3, 4, 6, 8, 12 are the nibbles of one constant: as an
// array, device code built the table in local memory at every call (the
// CUDA exact path's inner loop).
constexpr int indexer_e2m1_twice(uint32_t code) {
  const int m = int((0xC8643210u >> (4u * (code & 7u))) & 15u);
  return (code & 8u) ? -m : m;
}
static_assert(
    [] {
      for (uint32_t c = 0; c < 16; ++c)
        if (indexer_e2m1_twice(c) != int(2.0f * e2m1_to_float(uint8_t(c)))) return false;
      return true;
    }(),
    "indexer_e2m1_twice: twice e2m1_to_float for every code");

// 2^e as a double, e in [-1022, 1023].
constexpr double indexer_pow2(int e) { return std::bit_cast<double>(uint64_t(e + 1023) << 52); }

// 4 * the dot product of two 32-element e2m1 blocks (16 packed bytes each):
// an exact integer, |s| <= 4608.
constexpr int indexer_mxfp4_block_sum(const uint8_t* a, const uint8_t* b) {
  int s = 0;
  for (int i = 0; i < 16; ++i) {
    s += indexer_e2m1_twice(a[i] & 15u) * indexer_e2m1_twice(b[i] & 15u);
    s += indexer_e2m1_twice(a[i] >> 4) * indexer_e2m1_twice(b[i] >> 4);
  }
  return s;
}

// The MXFP4 dot product from the four block sums s[b] (4 * sum of e2m1
// products) and both records' UE8M0 scale bytes: block b weighs
// 2^(eq_b + ek_b - 2); the blocks are added in double in order 0..3 and the
// sum is rounded once to float. Every term is exact in double, so this is
// the correctly rounded exact dot whenever the block exponents of q and k
// span less than ~38 binades (always for real data). A NaN scale byte gives NaN.
DSV4_HD float indexer_mxfp4_combine(const int (&s)[4], const uint8_t* qs, const uint8_t* ks) {
  double acc = 0.0;
  for (int b = 0; b < 4; ++b) {
    if (qs[b] == 0xff || ks[b] == 0xff) return std::numeric_limits<float>::quiet_NaN();
    acc += double(s[b]) * indexer_pow2(int(qs[b]) + int(ks[b]) - 256);
  }
  return float(acc);
}

DSV4_HD float indexer_mxfp4_dot(const uint8_t* q, const uint8_t* qs, const uint8_t* k, const uint8_t* ks) {
  int s[4];
  for (int b = 0; b < 4; ++b) s[b] = indexer_mxfp4_block_sum(q + 16 * b, k + 16 * b);
  return indexer_mxfp4_combine(s, qs, ks);
}

// An e4m3 code's value times 512: an integer, |v| <= 229376. NaN codes give 0
// (callers check indexer_e4m3_is_nan).
constexpr int32_t indexer_e4m3_times512(uint8_t c) {
  const int32_t e = (c >> 3) & 15, m = c & 7;
  const int32_t mag = e == 0 ? m : (8 + m) << (e - 1);
  return (c & 0x80) ? -mag : mag;
}
constexpr bool indexer_e4m3_is_nan(uint8_t c) { return (c & 0x7f) == 0x7f; }

// The FP8 dot product from S = sum of (512 q_i)(512 k_i) (exact: |S| < 2^43)
// and both fp32 scales: S * 2^-18 * qs * ks in double, rounded once to float
// (the correctly rounded exact dot for power-of-two scales).
DSV4_HD float indexer_fp8_scale(double s, float qs, float ks) {
  return float(s * 0x1p-18 * double(qs) * double(ks));
}

DSV4_HD float indexer_fp8_dot(const uint8_t* q, float qs, const uint8_t* k, float ks) {
  int64_t s = 0;
  bool nan = false;
  for (int i = 0; i < kIndexDim; ++i) {
    nan = nan || indexer_e4m3_is_nan(q[i]) || indexer_e4m3_is_nan(k[i]);
    s += int64_t(indexer_e4m3_times512(q[i])) * int64_t(indexer_e4m3_times512(k[i]));
  }
  return nan ? std::numeric_limits<float>::quiet_NaN() : indexer_fp8_scale(double(s), qs, ks);
}

// One head's term: bf16(relu(bf16(dot)) * w), relu as std::max(x, 0.0f).
constexpr float indexer_term(float dot, float w) {
  const float r = round_bf16(dot);
  return round_bf16((r < 0.0f ? 0.0f : r) * w);
}

// The head sum in the order the GPU's accumulator layout gives: four partial
// sums, head h going to partial (h mod 8) / 2 in increasing h, then
// (p0 + p1) + (p2 + p3). (Starting a partial at +0 or at its first term only
// changes the sign of zero partials, which indexer_finish normalizes.)
struct IndexerHeadSum {
  float p[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  DSV4_HD void add(int h, float term) { p[(h & 7) >> 1] += term; }
  // Half i's sum: heads with (h & 7) >> 2 == i (a CUDA thread may hold one half).
  DSV4_HD float half(int i) const { return i == 0 ? p[0] + p[1] : p[2] + p[3]; }
  DSV4_HD float total() const { return half(0) + half(1); }
};

// The score from the head sum: -0 becomes +0, then bf16.
constexpr float indexer_finish(float total) { return round_bf16(total == 0.0f ? 0.0f : total); }

// Total order of candidates as one integer (bigger is better): a marker bit
// (so no real key is 0), the score's bf16 bits made monotone (NaN lowest),
// then 2^18 - 1 - j (ties to the lower j).
constexpr uint64_t indexer_order_key(float score, int64_t j) {
  const uint32_t u = std::bit_cast<uint32_t>(score);
  const uint32_t b = u >> 16;
  uint32_t ord = (b & 0x8000u) ? (~b & 0xffffu) : (b | 0x8000u);
  if ((u & 0x7fffffffu) > 0x7f800000u) ord = 0;
  return (uint64_t(1) << 34) | (uint64_t(ord) << 18) | uint64_t(kIndexerMaxKeys - 1 - j);
}
constexpr int32_t indexer_key_index(uint64_t key) { return int32_t(kIndexerMaxKeys - 1 - int64_t(key & 0x3ffffu)); }

}  // namespace dsv4
