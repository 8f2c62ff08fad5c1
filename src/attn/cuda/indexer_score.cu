// The indexer's scorer (see indexer_select_internal.cuh): one persistent CTA
// per multiprocessor, two consumer warpgroups. A unit is a group of up to 4
// tokens of one run and a range of key tiles; warpgroup w takes the unit's
// tiles w, w + 2, ...
//
// Per tile (64 keys = one page) a warpgroup
//  1. gathers the page's codes and scales into a shared-memory stage with
//     cp.async, kStages tiles ahead (rows beyond the visible keys are zero
//     filled and not read);
//  2. builds the A fragments (keys) in registers and runs, per token,
//     4 wgmma m64n64k32 steps against that token's 64 query heads (B, in
//     shared memory since the unit started); token t + 1's chain is issued
//     before token t's epilogue, into a second accumulator set:
//       MXFP4: s8 x s8 -> s32. Codes become 2 * e2m1 << (block exponent -
//              the vector's smallest), on both sides, so one exact integer
//              chain covers all four blocks: dot = acc * 2^(Eq + Ek) with
//              Eq, Ek the smallest block exponents minus 1. Needs every
//              block within 3 binades of the smallest (|int8| <= 96;
//              |acc| < 2^22); blocks whose codes are all zero do not count.
//       FP8:   e4m3 x e4m3 -> f32 (the tensor cores' accumulation, not the
//              CPU's exact dot: results may differ in the last bits).
//     The K dimension is permuted (the same way for keys and queries): a
//     lane's 16 contiguous code bytes of a row feed its A registers of all
//     four k-steps, so no shuffle is needed;
//  3. epilogue, per (key, head): bf16(relu(acc)) * w'' (w'' = w * 2^Eq as
//     bf16) rounded to bf16, summed over the lane's 16 heads in increasing
//     order, then over the quad ((p0 + p1) + (p2 + p3)): IndexerHeadSum's
//     order. score = bf16(sum) * 2^Ek. Since every step commutes with power
//     of two scaling while values stay normal, this equals the CPU's score
//     bit for bit when the exponents pass the fast path's checks (|Eq|,
//     |Ek| <= 32, w = 0 or 2^-32 <= |w| <= 2^32, no NaN scale). For a tile
//     with a key or token outside that, the exact scalar path (the CPU's
//     functions) overwrites the scores afterwards;
//  4. appends keys better than the token's threshold to the warpgroup's
//     candidate buffer; a full buffer is cut to the best k (radix select),
//     which raises the threshold.
// A group of one token (decode) takes its tiles two at a time, one wgmma
// chain each, so that two chains are in flight as with two tokens.
// At the unit's end the two warpgroups' candidates are cut to the best k
// per token and written as the unit's list (sorted best first when the
// group's lists carry bounds, see indexer_select_internal.cuh).
#include <cuda_runtime.h>

#include <type_traits>

#include "attn/cuda/indexer_mma.cuh"
#include "attn/cuda/indexer_select_internal.cuh"
#include "attn/cuda/indexer_topk.cuh"
#include "attn/cuda/pdl.cuh"
#include "attn/cuda/ptx.cuh"

namespace dsv4::cuda::ix {
namespace {

constexpr int kConsumers = 2;
constexpr int kStages = 4;                     // tiles in flight per warpgroup
constexpr int kBufCap = 1536;                  // candidates per (warpgroup, token)
constexpr int kBufPerThread = kBufCap / 128;     // keys per thread when a warpgroup cuts
constexpr int kMergePerThread = kConsumers * kBufCap / kScoreThreads;
constexpr int kSortPerThread = 4;  // a list of up to 4 * 256 = kIndexerMaxTopk keys sorted in write_lists
constexpr int kQTileBytes = kHeads * 128;      // one token's query heads, 128 bytes each
static_assert(kBufCap % 128 == 0 && (kConsumers * kBufCap) % kScoreThreads == 0, "buffer split");
static_assert(kBufCap - 2 * kTileKeys >= kIndexerMaxTopk, "a cut must leave room for a step");
static_assert(kSortPerThread * kScoreThreads >= kIndexerMaxTopk && kBufCap >= kIndexerMaxTopk, "write_lists' sort");

template <bool kFp8>
constexpr int stage_bytes() {
  return kTileKeys * (indexer_code_bytes(kFp8 ? IndexKeyFormat::kFp8 : IndexKeyFormat::kMxfp4) + kIndexerScaleBytes);
}

// Shared memory (offsets from a 1024-aligned base).
struct Misc {
  int unit;
  int all_ok;                              // every head of every token passes the fast path's checks
  int out_count;
  int tok_t[kGroupTokens];                 // global token index
  int tok_n[kGroupTokens];                 // visible keys
  int count[kConsumers][kGroupTokens];     // candidates in each buffer
  uint64_t tau[kConsumers][kGroupTokens];  // threshold: candidates must beat it (0: none yet)
  uint32_t sel[kConsumers + 1][2];         // with hist(i): [wg] warpgroup wg's compact, [kConsumers] write_lists
};
constexpr int kOffQ = 0;
constexpr int kOffStage = kOffQ + kGroupTokens * kQTileBytes;
template <bool kFp8>
constexpr int off_buf() {
  return kOffStage + kConsumers * kStages * stage_bytes<kFp8>();
}
template <bool kFp8>
constexpr int off_scores() {
  return off_buf<kFp8>() + kConsumers * kGroupTokens * kBufCap * 8;
}
template <bool kFp8>
constexpr int off_w() {
  return off_scores<kFp8>() + kConsumers * kGroupTokens * kTileKeys * 4;
}
template <bool kFp8>
constexpr int off_hist() {
  return off_w<kFp8>() + kGroupTokens * 4 * 8 * 4;  // [token][q][i] bf16x2 head weights
}
template <bool kFp8>
constexpr int off_misc() {
  return off_hist<kFp8>() + (kConsumers + 1) * 256 * 4;
}
template <bool kFp8>
constexpr int smem_bytes() {
  return off_misc<kFp8>() + int(sizeof(Misc)) + 1024;  // + room to align the base
}
static_assert(smem_bytes<true>() <= 227 * 1024 && smem_bytes<false>() <= 227 * 1024, "one CTA per SM");

struct Smem {
  uint8_t* base;
  template <bool kFp8>
  __device__ uint64_t* buf(int wg, int tl) const {
    return reinterpret_cast<uint64_t*>(base + off_buf<kFp8>()) + (wg * kGroupTokens + tl) * kBufCap;
  }
  template <bool kFp8>
  __device__ float* scores(int wg, int tl) const {
    return reinterpret_cast<float*>(base + off_scores<kFp8>()) + (wg * kGroupTokens + tl) * kTileKeys;
  }
  template <bool kFp8>
  __device__ uint32_t* wpairs() const {
    return reinterpret_cast<uint32_t*>(base + off_w<kFp8>());
  }
  template <bool kFp8>
  __device__ uint32_t* hist(int i) const {
    return reinterpret_cast<uint32_t*>(base + off_hist<kFp8>()) + 256 * i;
  }
  template <bool kFp8>
  __device__ Misc* misc() const {
    return reinterpret_cast<Misc*>(base + off_misc<kFp8>());
  }
  template <bool kFp8>
  __device__ uint8_t* stage(int wg, int s) const {
    if (s < kStages) return base + kOffStage + (wg * kStages + s) * stage_bytes<kFp8>();
    return reinterpret_cast<uint8_t*>(buf<kFp8>(wg, 1)) + (s - kStages) * stage_bytes<kFp8>();
  }
};
// A one-token group takes its tiles in pairs (consume) and keeps more of
// them in flight: its stages kStages and up lie in the warpgroup's candidate
// buffers of tokens 1 .. 3, which such a group does not use.
constexpr int kSoloStages = 2 * kStages;
static_assert((kSoloStages - kStages) * stage_bytes<true>() <= (kGroupTokens - 1) * kBufCap * 8 &&
                  (kSoloStages - kStages) * stage_bytes<false>() <= (kGroupTokens - 1) * kBufCap * 8,
              "solo stages in the unused buffers");

// Byte offset of 16-byte chunk c of row r in a 128-byte-row tile with the
// 128B swizzle wgmma expects (8-row atoms of 1024 bytes).
__device__ __forceinline__ int swz(int r, int c) { return r * 128 + (((c ^ r) & 7) << 4); }

// Exponent bounds of the fast path (see the file comment).
constexpr int kFastExp = 32;
__device__ __forceinline__ bool weight_ok(float w) {
  const float a = fabsf(w);
  return a == 0.0f || (a >= 0x1p-32f && a <= 0x1p32f);
}

// The fold of one MXFP4 record from its scale word and which blocks hold a
// nonzero code: the smallest exponent among those blocks, each block's shift
// above it, and whether the fast path can take it.
struct Fold {
  int emin;
  int shift[4];
  bool ok;
};
// Written without branches: it feeds the A fragments, and a divergent branch
// there makes ptxas serialize the wgmma chains.
__device__ __forceinline__ Fold mxfp4_fold(uint32_t scale_word, uint32_t nonzero) {
  Fold f;
  int e[4];
  bool used[4];
  int lo = 1000, hi = -1000;
  bool nan = false;
#pragma unroll
  for (int b = 0; b < 4; ++b) {
    const int byte = int((scale_word >> (8 * b)) & 0xffu);
    e[b] = byte - 127;
    used[b] = ((nonzero >> b) & 1u) != 0;
    nan |= byte == 0xff;
    lo = min(lo, used[b] ? e[b] : 1000);
    hi = max(hi, used[b] ? e[b] : -1000);
  }
  const bool none = hi < lo;  // all codes zero: any exponent; Eq = 0
  lo = none ? 1 : lo;
  hi = none ? 1 : hi;
  f.emin = lo;
#pragma unroll
  for (int b = 0; b < 4; ++b) f.shift[b] = used[b] ? min(max(e[b] - lo, 0), 3) : 0;
  f.ok = !nan & (hi - lo <= 3) & (lo - 1 >= -kFastExp) & (lo - 1 <= kFastExp);
  return f;
}
// An FP8 record's scale: a positive normal power of two with a small exponent.
__device__ __forceinline__ bool fp8_scale_ok(float s, int& exponent) {
  const uint32_t u = __float_as_uint(s);
  exponent = int(u >> 23) - 127;
  return (u & 0x807fffffu) == 0 && exponent >= -kFastExp && exponent <= kFastExp;
}

__device__ __forceinline__ uint32_t nonzero_e2m1(uint32_t w) { return (w & 0x77777777u) != 0 ? 1u : 0u; }

// ---- the unit's queries --------------------------------------------------------
// Thread (tl, h) = (tid / 64, tid % 64) writes B row h of token tl: chunk c
// word qq holds dims 32 qq + 4 c .. + 3 (the permuted K order of the A
// fragments, see score_tile), and the head's w'' into the weight pairs.
template <bool kFp8>
__device__ void load_queries(const IndexerSelectParams& p, const Smem& s, const Group& gr) {
  Misc* m = s.misc<kFp8>();
  const int tid = threadIdx.x, tl = tid >> 6, h = tid & 63;
  bool ok = true;
  if (tl < gr.count) {
    const int t = gr.first + tl;
    const int64_t e = int64_t(t) * kHeads + h;
    uint8_t* row = s.base + kOffQ + tl * kQTileBytes;
    int eq = 0;
    if constexpr (kFp8) {
      const uint4* rec = reinterpret_cast<const uint4*>(p.queries.codes + e * kIndexDim);
      uint32_t w[32];
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const uint4 v = __ldg(rec + i);
        w[4 * i] = v.x, w[4 * i + 1] = v.y, w[4 * i + 2] = v.z, w[4 * i + 3] = v.w;
      }
#pragma unroll
      for (int c = 0; c < 8; ++c)
        *reinterpret_cast<uint4*>(row + swz(h, c)) = make_uint4(w[c], w[8 + c], w[16 + c], w[24 + c]);
      const float qs = __ldg(reinterpret_cast<const float*>(p.queries.scales + e * kIndexerScaleBytes));
      ok = fp8_scale_ok(qs, eq);
    } else {
      const uint4* rec = reinterpret_cast<const uint4*>(p.queries.codes + e * (kIndexDim / 2));
      uint32_t w[16];
      uint32_t nonzero = 0;
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const uint4 v = __ldg(rec + i);
        w[4 * i] = v.x, w[4 * i + 1] = v.y, w[4 * i + 2] = v.z, w[4 * i + 3] = v.w;
        nonzero |= (nonzero_e2m1(v.x | v.y | v.z | v.w)) << i;  // block i = 16 bytes
      }
      const uint32_t sw = __ldg(reinterpret_cast<const uint32_t*>(p.queries.scales + e * kIndexerScaleBytes));
      const Fold f = mxfp4_fold(sw, nonzero);
      ok = f.ok;
      eq = f.emin - 1;
#pragma unroll
      for (int c = 0; c < 8; ++c) {
        uint32_t o[4];
#pragma unroll
        for (int qq = 0; qq < 4; ++qq) {
          // dims 32 qq + 4 c .. + 3: bytes 16 qq + 2 c, + 1 of the record
          const uint32_t word = w[4 * qq + (c >> 1)];
          o[qq] = e2m1x4_to_s8((c & 1) ? (word >> 16) : (word & 0xffffu), f.shift[qq]);
        }
        *reinterpret_cast<uint4*>(row + swz(h, c)) = make_uint4(o[0], o[1], o[2], o[3]);
      }
    }
    const float w = __ldg(p.queries.weights + e);
    ok = ok && weight_ok(w);
    const float w2 = __fmul_rn(w, exp2_int(min(max(eq, -kFastExp), kFastExp)));  // exact when ok
    reinterpret_cast<uint16_t*>(s.wpairs<kFp8>())[((tl * 4 + ((h & 7) >> 1)) * 8 + (h >> 3)) * 2 + (h & 1)] =
        bf16_bits(w2);
    if (h == 0) {
      m->tok_t[tl] = t;
      m->tok_n[tl] = int(indexer_visible(p.positions[t]));
    }
  }
  if (tid < kConsumers * kGroupTokens) {
    m->count[tid / kGroupTokens][tid % kGroupTokens] = 0;
    m->tau[tid / kGroupTokens][tid % kGroupTokens] = 0;
  }
  fence_proxy_async();  // generic writes of B, read by wgmma (async proxy)
  const int all = __syncthreads_and(ok);
  if (tid == 0) m->all_ok = all;
  __syncthreads();
}

// ---- keys: cp.async of one page into a stage ----------------------------------------
struct TileRef {
  const uint8_t* page;  // null: no page (the tile has no keys)
  int64_t j0;
};
__device__ __forceinline__ TileRef tile_ref(const IndexerSelectParams& p, int run, int tile) {
  const BlockTableView& tb = p.c4a_table;
  const int64_t col = int64_t(tile) - tb.first[run];
  int32_t page = -1;
  if (col >= 0 && col < tb.width) page = tb.pages[int64_t(run) * tb.width + col];
  TileRef r{nullptr, int64_t(tile) * kTileKeys};
  if (page >= 0 && page < p.keys.num_pages) r.page = p.keys.base + size_t(page) * p.keys.page_stride;
  return r;
}

// Stage layout = the page's: codes of rows 0..63, then their 4 scale bytes.
// Rows at or beyond n_max are zero filled without a read (`dummy`, any
// global address, stands in for their source).
template <bool kFp8>
__device__ __forceinline__ void issue_tile(const TileRef& ref, uint8_t* stage, int n_max, int wt, const void* dummy) {
  constexpr int kCode = kFp8 ? kIndexDim : kIndexDim / 2;
  constexpr int kChunks = stage_bytes<kFp8>() / 16, kCodeChunks = kTileKeys * kCode / 16;
  const uint32_t dst = smem_u32(stage);
  for (int c = wt; c < kChunks; c += 128) {
    bool valid = ref.page != nullptr;
    if (c < kCodeChunks) valid = valid && ref.j0 + c / (kCode / 16) < n_max;
    cp_async_16(dst + 16 * c, valid ? static_cast<const void*>(ref.page + size_t(c) * 16) : dummy, valid ? 16u : 0u);
  }
}

// ---- epilogue ----------------------------------------------------------------------
// Scores of rows g and g + 8 of this warp for one token (all four lanes of a
// quad return them): see step 3 of the file comment.
template <typename Acc>
__device__ __forceinline__ void tile_epilogue(const Acc (&acc)[32], const uint32_t* wpairs_tq, float& s0, float& s1) {
  const uint4 wa = *reinterpret_cast<const uint4*>(wpairs_tq), wb = *reinterpret_cast<const uint4*>(wpairs_tq + 4);
  const uint32_t wp[8] = {wa.x, wa.y, wa.z, wa.w, wb.x, wb.y, wb.z, wb.w};
  float p0 = 0.0f, p1 = 0.0f;
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    float x[4];
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      if constexpr (std::is_integral_v<Acc>)  // s32 accumulators (MXFP4)
        x[c] = s32_to_float_exact(uint32_t(acc[4 * i + c]));
      else
        x[c] = float(acc[4 * i + c]);
    }
    const uint32_t m01 = bf16x2_mul(relu_bf16x2(x[0], x[1]), wp[i]);
    const uint32_t m23 = bf16x2_mul(relu_bf16x2(x[2], x[3]), wp[i]);
    p0 = __fadd_rn(p0, bf16x2_lo(m01));
    p0 = __fadd_rn(p0, bf16x2_hi(m01));
    p1 = __fadd_rn(p1, bf16x2_lo(m23));
    p1 = __fadd_rn(p1, bf16x2_hi(m23));
  }
  p0 = __fadd_rn(p0, __shfl_xor_sync(0xffffffffu, p0, 1));
  p0 = __fadd_rn(p0, __shfl_xor_sync(0xffffffffu, p0, 2));
  p1 = __fadd_rn(p1, __shfl_xor_sync(0xffffffffu, p1, 1));
  p1 = __fadd_rn(p1, __shfl_xor_sync(0xffffffffu, p1, 2));
  s0 = indexer_finish(p0);
  s1 = indexer_finish(p1);
}

// The exact scalar path for one tile: the CPU twin's arithmetic per (token,
// key), into the score slots slot0 + token.
template <bool kFp8>
__device__ void tile_exact(const IndexerSelectParams& p, const Smem& s, const uint8_t* stage, int wg, int wt, int G,
                           int64_t j0, int slot0) {
  constexpr int kCode = kFp8 ? kIndexDim : kIndexDim / 2;
  const Misc* m = s.misc<kFp8>();
  for (int pair = wt; pair < G * kTileKeys; pair += 128) {
    const int tl = pair / kTileKeys, r = pair % kTileKeys;
    if (j0 + r >= m->tok_n[tl]) continue;
    const uint8_t* kc = stage + r * kCode;
    const uint8_t* ks = stage + kTileKeys * kCode + r * kIndexerScaleBytes;
    const int64_t e0 = int64_t(m->tok_t[tl]) * kHeads;
    IndexerHeadSum hs;
    for (int h = 0; h < kHeads; ++h) {
      const uint8_t* qc = p.queries.codes + (e0 + h) * kCode;
      const uint8_t* qs = p.queries.scales + (e0 + h) * kIndexerScaleBytes;
      float v;
      if constexpr (kFp8)
        v = indexer_fp8_dot(qc, *reinterpret_cast<const float*>(qs), kc, *reinterpret_cast<const float*>(ks));
      else
        v = indexer_mxfp4_dot(qc, qs, kc, ks);
      hs.add(h, indexer_term(v, p.queries.weights[e0 + h]));
    }
    s.scores<kFp8>(wg, slot0 + tl)[r] = indexer_finish(hs.total());
  }
}

__device__ __forceinline__ void wg_sync(int wg) { bar_sync(1 + wg, 128); }

// ---- the tiles of one step of a warpgroup --------------------------------------------
// kG tokens x kT tiles (kT = 2 only for one token): kG * kT wgmma chains, the
// scores of chain c = (token c, or tile c when kT = 2) into score slot c.
// kG and kT are template parameters so that no branch depends on them while
// a wgmma chain is in flight (ptxas would serialize the chains). A tile whose
// j0 is n_max or more has no visible key (its stage is not read for scores).
template <bool kFp8, int kG, int kT>
__device__ void score_tiles(const IndexerSelectParams& p, const Smem& s, const uint8_t* const (&stage)[kT], int wg,
                            const int64_t (&j0)[kT], int n_max) {
  static_assert(kT == 1 || kG == 1, "pairs of tiles for one token only");
  constexpr int kCode = kFp8 ? kIndexDim : kIndexDim / 2;
  constexpr int kChains = kG * kT;
  const int wt = threadIdx.x & 127, warp = wt >> 5, lane = wt & 31, g = lane >> 2, q = lane & 3;
  const int r0 = 16 * warp + g, r1 = r0 + 8;
  const Misc* m = s.misc<kFp8>();
  uint32_t a[kT][4][4];  // A fragments: k-step st takes word st (MXFP4: 8 codes) or words 2 st, 2 st + 1 (FP8)
  float kscale0[kT], kscale1[kT];
  bool ok = true;
#pragma unroll
  for (int u = 0; u < kT; ++u) {
    const bool valid0 = j0[u] + r0 < n_max, valid1 = j0[u] + r1 < n_max;
    // This lane's 32 elements of each of its two rows (bytes 16 q.. of an
    // MXFP4 row = block q; bytes 32 q.. of an FP8 row) and the rows' scales.
    uint32_t w0[kFp8 ? 8 : 4], w1[kFp8 ? 8 : 4];
#pragma unroll
    for (int i = 0; i < (kFp8 ? 2 : 1); ++i) {
      const uint4 x = *reinterpret_cast<const uint4*>(stage[u] + r0 * kCode + (kFp8 ? 32 : 16) * q + 16 * i);
      const uint4 y = *reinterpret_cast<const uint4*>(stage[u] + r1 * kCode + (kFp8 ? 32 : 16) * q + 16 * i);
      w0[4 * i] = x.x, w0[4 * i + 1] = x.y, w0[4 * i + 2] = x.z, w0[4 * i + 3] = x.w;
      w1[4 * i] = y.x, w1[4 * i + 1] = y.y, w1[4 * i + 2] = y.z, w1[4 * i + 3] = y.w;
    }
    const uint32_t sc0 = *reinterpret_cast<const uint32_t*>(stage[u] + kTileKeys * kCode + r0 * kIndexerScaleBytes);
    const uint32_t sc1 = *reinterpret_cast<const uint32_t*>(stage[u] + kTileKeys * kCode + r1 * kIndexerScaleBytes);
    int ek0 = 0, ek1 = 0, shift0 = 0, shift1 = 0;
    if constexpr (kFp8) {
      const bool ok0 = fp8_scale_ok(__uint_as_float(sc0), ek0), ok1 = fp8_scale_ok(__uint_as_float(sc1), ek1);
      ok = ok & (!valid0 | ok0) & (!valid1 | ok1);
    } else {
      // Which blocks of the two rows hold a nonzero code: lanes 4 g .. 4 g + 3 hold blocks 0..3.
      const uint32_t nz0 = __ballot_sync(0xffffffffu, nonzero_e2m1(w0[0] | w0[1] | w0[2] | w0[3]) != 0);
      const uint32_t nz1 = __ballot_sync(0xffffffffu, nonzero_e2m1(w1[0] | w1[1] | w1[2] | w1[3]) != 0);
      const Fold f0 = mxfp4_fold(sc0, (nz0 >> (4 * g)) & 0xfu), f1 = mxfp4_fold(sc1, (nz1 >> (4 * g)) & 0xfu);
      ek0 = f0.emin - 1;
      ek1 = f1.emin - 1;
      shift0 = f0.shift[q];
      shift1 = f1.shift[q];
      ok = ok & (!valid0 | f0.ok) & (!valid1 | f1.ok);
    }
#pragma unroll
    for (int st = 0; st < 4; ++st) {
      if constexpr (kFp8) {
        a[u][st][0] = w0[2 * st];
        a[u][st][1] = w1[2 * st];
        a[u][st][2] = w0[2 * st + 1];
        a[u][st][3] = w1[2 * st + 1];
      } else {
        a[u][st][0] = e2m1x4_to_s8(w0[st] & 0xffffu, shift0);
        a[u][st][1] = e2m1x4_to_s8(w1[st] & 0xffffu, shift1);
        a[u][st][2] = e2m1x4_to_s8(w0[st] >> 16, shift0);
        a[u][st][3] = e2m1x4_to_s8(w1[st] >> 16, shift1);
      }
    }
    kscale0[u] = exp2_int(ek0);
    kscale1[u] = exp2_int(ek1);
  }
  // Warpgroup-wide: any key outside the fast path's range? (Also a barrier.)
  uint32_t bad;
  asm volatile(
      "{\n.reg .pred p, r;\nsetp.eq.u32 p, %1, 0;\nbar.red.or.pred r, %2, 128, p;\nselp.u32 %0, 1, 0, r;\n}\n"
      : "=r"(bad)
      : "r"(uint32_t(ok)), "r"(1 + wg)
      : "memory");
  // Materialize the fragments here: left to the scheduler, the conversions
  // sink between the wgmmas and ptxas must insert fences there.
#pragma unroll
  for (int u = 0; u < kT; ++u)
#pragma unroll
    for (int st = 0; st < 4; ++st)
#pragma unroll
      for (int i = 0; i < 4; ++i) asm volatile("" : "+r"(a[u][st][i]));
  const uint32_t qbase = smem_u32(s.base + kOffQ);
  // Chain c + 1 runs while chain c's epilogue does (two accumulator sets).
  using Acc = std::conditional_t<kFp8, float, uint32_t>;
  Acc acc0[32], acc1[32];
  auto issue = [&](int c, Acc(&acc)[32]) {
    const int tl = kT == 1 ? c : 0, u = kT == 1 ? 0 : c;
#pragma unroll
    for (int i = 0; i < 32; ++i) acc[i] = Acc(0);  // overwritten (scale-d 0)
    const uint64_t db = sw128_desc(qbase + tl * kQTileBytes, 16, 1024);
    wgmma_fence();
    if constexpr (kFp8) {
      wgmma_e4m3_rs<0>(acc, a[u][0], db);
      wgmma_e4m3_rs<1>(acc, a[u][1], db + 2);  // + 32 bytes per k-step (descriptor units of 16)
      wgmma_e4m3_rs<1>(acc, a[u][2], db + 4);
      wgmma_e4m3_rs<1>(acc, a[u][3], db + 6);
    } else {
      wgmma_s8_rs<0>(acc, a[u][0], db);
      wgmma_s8_rs<1>(acc, a[u][1], db + 2);
      wgmma_s8_rs<1>(acc, a[u][2], db + 4);
      wgmma_s8_rs<1>(acc, a[u][3], db + 6);
    }
    wgmma_commit();
  };
  issue(0, acc0);
#pragma unroll
  for (int c = 0; c < kChains; ++c) {
    const int tl = kT == 1 ? c : 0, u = kT == 1 ? 0 : c;
    Acc(&cur)[32] = (c & 1) ? acc1 : acc0;
    if (c + 1 < kChains) {
      issue(c + 1, (c & 1) ? acc0 : acc1);
      wgmma_wait<1>();  // chain c is done, c + 1 may run on
    } else {
      wgmma_wait<0>();
    }
    fence_acc(cur);
    float s0, s1;
    tile_epilogue(cur, s.wpairs<kFp8>() + (tl * 4 + q) * 8, s0, s1);
    // Every lane of the quad holds both scores: all store (no divergent
    // branch while the next chain is in flight).
    float* out = s.scores<kFp8>(wg, c);
    out[r0] = __fmul_rn(s0, kscale0[u]);
    out[r1] = __fmul_rn(s1, kscale1[u]);
  }
  // A key or token outside the fast path's range: the exact path overwrites
  // the tile's scores. (After the chains, not around them: a wgmma under a
  // data-dependent branch makes ptxas serialize the chains.)
  if (bad || !m->all_ok) {
    wg_sync(wg);  // the fast path's stores land first
#pragma unroll
    for (int u = 0; u < kT; ++u) tile_exact<kFp8>(p, s, stage[u], wg, wt, kG, j0[u], u);
  }
}

// Cuts a warpgroup's buffer of one token to its best k; raises the threshold.
template <bool kFp8>
__device__ void compact(const Smem& s, int wg, int tl, int k) {
  const int wt = threadIdx.x & 127, lane = wt & 31;
  Misc* m = s.misc<kFp8>();
  uint64_t* buf = s.buf<kFp8>(wg, tl);
  const int n = m->count[wg][tl];
  uint64_t keys[kBufPerThread];
#pragma unroll
  for (int i = 0; i < kBufPerThread; ++i) keys[i] = wt + 128 * i < n ? buf[wt + 128 * i] : 0;
  const uint64_t kth = radix_kth<8, false>(
      [&](auto&& f) {
#pragma unroll
        for (int i = 0; i < kBufPerThread; ++i) f(keys[i]);
      },
      uint32_t(k), s.hist<kFp8>(wg), m->sel[wg], wt, 128, [&] { wg_sync(wg); });
  if (wt == 0) {
    m->count[wg][tl] = 0;
    m->tau[wg][tl] = kth;
  }
  wg_sync(wg);
#pragma unroll
  for (int i = 0; i < kBufPerThread; ++i) warp_append(keys[i] >= kth, keys[i], buf, &m->count[wg][tl], lane);
  wg_sync(wg);
}

// A warpgroup's tiles of the unit: tile_begin + wg, + 2, ... A one-token
// group takes them two at a time (two wgmma chains in flight, half the
// barriers per tile and every thread in the append), with kSoloStages in
// flight: alone, a token's tile is a short chain of dependent steps. An odd
// last tile (the only one at short context) is scored alone.
template <bool kFp8, bool kSelect, int kG>
__device__ void consume(const IndexerSelectParams& p, const Smem& s, const Group& gr, const Unit& un) {
  constexpr int kT = kG == 1 ? 2 : 1;  // tiles per step
  constexpr int kS = kG == 1 ? kSoloStages : kStages;
  const int wg = threadIdx.x >> 7, wt = threadIdx.x & 127, lane = wt & 31;
  Misc* m = s.misc<kFp8>();
  int n_max = 0;
  for (int tl = 0; tl < kG; ++tl) n_max = max(n_max, m->tok_n[tl]);
  const int first = un.tile_begin + wg;
  const int mine = first < un.tile_end ? (un.tile_end - first + 1) / 2 : 0;
  auto tile_of = [&](int i) { return first + 2 * i; };
  auto issue = [&](int i) {  // one commit group per tile, empty past the last
    if (i < mine) issue_tile<kFp8>(tile_ref(p, gr.run, tile_of(i)), s.stage<kFp8>(wg, i % kS), n_max, wt, p.queries.codes);
    cp_async_commit();
  };
  for (int i = 0; i < kS - kT; ++i) issue(i);
  for (int i = 0; i < mine; i += kT) {
#pragma unroll
    for (int u = 0; u < kT; ++u) issue(i + kS - kT + u);
    cp_async_wait_group<kS - kT>();  // this thread's copies of tiles i .. i + kT - 1 have landed
    wg_sync(wg);                     // and everyone's
    const uint8_t* stage[kT];
    int64_t j0[kT];
    bool any = false;
#pragma unroll
    for (int u = 0; u < kT; ++u) {
      const TileRef ref = i + u < mine ? tile_ref(p, gr.run, tile_of(i + u)) : TileRef{nullptr, 0};
      stage[u] = s.stage<kFp8>(wg, (i + u) % kS);
      j0[u] = ref.page != nullptr ? ref.j0 : int64_t(n_max);  // no page: no keys
      any |= ref.page != nullptr;
    }
    if (!any) continue;  // uniform
    if (kT == 2 && i + 1 == mine) {  // an odd last tile alone: no second chain for nothing
      const uint8_t* const one[1] = {stage[0]};
      const int64_t j1[1] = {j0[0]};
      score_tiles<kFp8, 1, 1>(p, s, one, wg, j1, n_max);
    } else {
      score_tiles<kFp8, kG, kT>(p, s, stage, wg, j0, n_max);
    }
    wg_sync(wg);  // scores visible
    if constexpr (kSelect) {
      for (int base = 0; base < kG * kT * kTileKeys; base += 128) {
        const int pair = base + wt, c = min(pair / kTileKeys, kGroupTokens - 1), r = pair % kTileKeys;
        const int tl = kT == 1 ? c : 0;
        const int64_t j = (c == 0 ? j0[0] : j0[kT - 1]) + r;  // kT = 2: tile c
        bool take = pair < kG * kT * kTileKeys && j < m->tok_n[tl];
        const uint64_t key = take ? indexer_order_key(s.scores<kFp8>(wg, c)[r], j) : 0;
        take = take && key > m->tau[wg][tl];
        warp_append(take, key, s.buf<kFp8>(wg, tl), &m->count[wg][tl], lane);  // a warp's pairs share tl
      }
      wg_sync(wg);
      for (int tl = 0; tl < kG; ++tl)  // cut when another step might not fit
        if (m->count[wg][tl] > kBufCap - kT * kTileKeys) compact<kFp8>(s, wg, tl, p.topk);
    }
  }
  cp_async_wait_group<0>();
}

// The unit's list per token: the best k of both warpgroups' candidates.
template <bool kFp8>
__device__ void write_lists(const SelectArgs& a, const Smem& s, const Group& gr, const Unit& un) {
  const int tid = threadIdx.x, lane = tid & 31;
  Misc* m = s.misc<kFp8>();
  const int k = a.p.topk;
  for (int tl = 0; tl < gr.count; ++tl) {
    const int n0 = m->count[0][tl], n = n0 + m->count[1][tl];
    uint64_t keys[kMergePerThread];
#pragma unroll
    for (int i = 0; i < kMergePerThread; ++i) {
      const int idx = tid + kScoreThreads * i;
      keys[i] = idx < n0 ? s.buf<kFp8>(0, tl)[idx] : (idx < n ? s.buf<kFp8>(1, tl)[idx - n0] : 0);
    }
    auto kth_of = [&](int need) {
      return radix_kth<8, false>(
          [&](auto&& f) {
#pragma unroll
            for (int i = 0; i < kMergePerThread; ++i) f(keys[i]);
          },
          uint32_t(need), s.hist<kFp8>(kConsumers), m->sel[kConsumers], tid, kScoreThreads, [] { __syncthreads(); });
    };
    const uint64_t kth = n > k ? kth_of(k) : 1;  // fewer than k: keep every key
    const int64_t list = int64_t(gr.list_base) + int64_t(un.split) * gr.count + tl;
    uint64_t* out = a.ws.list_keys + list * a.ws.list_stride;
    if (has_list_bounds(gr)) {
      // The list sorted best first, so that finalize reads only its keys at
      // or above the token's bound, a prefix (indexer_select_internal.cuh);
      // the bound is then the sorted list's m-th key. Sorted in buf(0, tl),
      // whose keys every thread holds in registers by the barrier below.
      uint64_t* sorted = s.buf<kFp8>(0, tl);
      __syncthreads();
#pragma unroll
      for (int i = 0; i < kMergePerThread; ++i)
        warp_append(keys[i] != 0 && keys[i] >= kth, keys[i], sorted, &m->out_count, lane);
      __syncthreads();
      const int kept = m->out_count;
      bitonic_sort_desc<kScoreThreads, kSortPerThread>(sorted, kept, tid);
      for (int i = tid; i < kept; i += kScoreThreads) out[i] = sorted[i];
      if (tid == 0) {
        const int need = (k + gr.units - 1) / gr.units;  // m = ceil(k / units)
        a.ws.list_bounds[list] = kept >= need ? sorted[need - 1] : 0;
        a.ws.list_counts[list] = kept;
        m->out_count = 0;
      }
      __syncthreads();
      continue;
    }
#pragma unroll
    for (int i = 0; i < kMergePerThread; ++i) warp_append(keys[i] != 0 && keys[i] >= kth, keys[i], out, &m->out_count, lane);
    __syncthreads();
    if (tid == 0) {
      a.ws.list_counts[list] = m->out_count;
      m->out_count = 0;
    }
    __syncthreads();
  }
}

template <bool kFp8, bool kSelect>
__global__ void __launch_bounds__(kScoreThreads, 1) score_kernel(const SelectArgs a) {
  // Units are taken in turn: CTA b first takes unit b, then units from the
  // counter (past the grid). The plan is read before the wait: the plan
  // kernel lets nothing start before it ends (indexer_plan.cu).
  const int units = a.ws.counters->units;
  int u = blockIdx.x;
  Unit un = u < units ? a.ws.units[u] : Unit{};
  Group gr = u < units ? a.ws.groups[un.group] : Group{};
  pdl_start();  // pdl.cuh: launched with pdl_launch
  extern __shared__ uint8_t smem_raw[];
  // The 1024-aligned base as smem_raw plus a pad: derived from the shared
  // array, so the compiler knows every access through it is to shared memory.
  // (Rebuilt from an integer it made them generic loads, stores and gpu-scope
  // atomics: Nsight Compute, run J2.)
  const Smem s{smem_raw + ((1024u - (smem_u32(smem_raw) & 1023u)) & 1023u)};
  Misc* m = s.misc<kFp8>();
  if (threadIdx.x == 0) m->out_count = 0;
  // m->unit: thread 0 writes it before the barrier at the loop's end, every
  // thread reads it after; the next write comes after the CTA barriers in
  // load_queries, after consume and in write_lists, all passed after those reads.
  // (compute-sanitizer racecheck reports this pair, and hist(2) / sel[2] in
  // write_lists, as hazards; since the shared accesses are no longer generic,
  // also hist(wg) / sel[wg] in compact, ordered by the warpgroup's named
  // barrier; and in write_lists' sorted lists, the loads of buf(0, tl) into
  // keys[] against the appends and the sort that rewrite it, and the sort's
  // last stores against the reads of the sorted list. Each write_lists pair
  // is ordered by a __syncthreads of all 256 threads, and the same radix_kth
  // under __syncthreads in finalize_kernel is reported clean: the tool seems
  // to mis-pair barrier 0 once the two warpgroups have passed different
  // numbers of their named barriers 1 + wg, as one-token groups with an odd
  // number of tiles or tiles without pages make them do.)
  while (u < units) {
    load_queries<kFp8>(a.p, s, gr);
    switch (gr.count) {  // uniform: one instantiation per group size
      case 1: consume<kFp8, kSelect, 1>(a.p, s, gr, un); break;
      case 2: consume<kFp8, kSelect, 2>(a.p, s, gr, un); break;
      case 3: consume<kFp8, kSelect, 3>(a.p, s, gr, un); break;
      default: consume<kFp8, kSelect, 4>(a.p, s, gr, un); break;
    }
    __syncthreads();
    if constexpr (kSelect) {
      write_lists<kFp8>(a, s, gr, un);
    } else {
      if (threadIdx.x < gr.count)
        a.ws.list_counts[int64_t(gr.list_base) + int64_t(un.split) * gr.count + threadIdx.x] = 0;
      __syncthreads();
    }
    if (units <= int(gridDim.x)) break;  // every unit was someone's first
    if (threadIdx.x == 0) m->unit = int(gridDim.x) + atomicAdd(&a.ws.counters->next_unit, 1);
    __syncthreads();
    u = m->unit;
    if (u < units) {
      un = a.ws.units[u];
      gr = a.ws.groups[un.group];
    }
  }
}

template <bool kFp8, bool kSelect>
void launch(const SelectArgs& a, int grid, cudaStream_t stream) {
  pdl_launch(score_kernel<kFp8, kSelect>, grid, kScoreThreads, smem_bytes<kFp8>(), stream, a);
}

}  // namespace

int score_smem_bytes(IndexKeyFormat f) { return f == IndexKeyFormat::kFp8 ? smem_bytes<true>() : smem_bytes<false>(); }

void prepare_score_kernels() {
  cudaFuncSetAttribute(score_kernel<true, true>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes<true>());
  cudaFuncSetAttribute(score_kernel<true, false>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes<true>());
  cudaFuncSetAttribute(score_kernel<false, true>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes<false>());
  cudaFuncSetAttribute(score_kernel<false, false>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes<false>());
}

void launch_score(const SelectArgs& a, int grid, bool score_only, cudaStream_t stream) {
  const bool fp8 = a.p.queries.format == IndexKeyFormat::kFp8;
  if (fp8) {
    if (score_only) launch<true, false>(a, grid, stream);
    else launch<true, true>(a, grid, stream);
  } else {
    if (score_only) launch<false, false>(a, grid, stream);
    else launch<false, true>(a, grid, stream);
  }
}

}  // namespace dsv4::cuda::ix
