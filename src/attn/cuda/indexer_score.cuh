#pragma once
// The indexer's tile scorer, shared by the persistent unit kernel
// (indexer_score.cu) and the short-row kernel (indexer_short.cu).
//
// The indexer's scorer (see indexer_select_internal.cuh): one persistent CTA
// per multiprocessor of kW consumer warpgroups. A unit is a group of tokens
// of one run and a range of key tiles; warpgroup w takes the unit's tiles
// w, w + kW, ... Two shapes (Shape below):
//  * general: groups of up to 4 tokens (any step); 3 warpgroups (at 2,
//             8 warps an SM, it was bound by latency); FP8 keys, whose
//             stages take twice the shared memory, keep fewer in flight;
//             above top-512 the candidate buffers are larger, the stages
//             fewer (GeneralWide);
//  * decode:  4 warpgroups, groups of one token (a plan that groups tokens
//             one by one, which the host asks for on decode steps). One
//             wgmma chain per step needs 128 registers or fewer, so the CTA
//             holds twice the warps: at batch 1 the tile loop is bound by
//             its instruction stream and latencies, not by the tensor cores.
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
//              The decode shape runs a second chain per token: the keys'
//              negative codes as magnitudes against the negated queries
//              (Shape::kSplitSigns), the same integer sum.
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
//     |Ek| <= 32, w = 0 or 2^-48 <= |w| <= 2^32, no NaN scale). For a token
//     outside that, the exact scalar path (the CPU's functions) overwrites
//     its scores afterwards; for a key outside it, every token's of the tile;
//  4. appends keys better than the token's threshold to the warpgroup's
//     candidate buffer; a full buffer is cut to its best k, or a few more
//     (radix select), which raises the threshold.
// At the unit's end the warpgroups' candidates are cut to the best k per
// token and written as the unit's list (sorted best first when the group's
// lists carry bounds, see indexer_select_internal.cuh).
#include <cuda_runtime.h>

#include <type_traits>

#include "attn/cuda/indexer_exact.cuh"
#include "attn/cuda/indexer_mma.cuh"
#include "attn/cuda/indexer_select_internal.cuh"
#include "attn/cuda/indexer_topk.cuh"
#include "attn/cuda/pdl.cuh"
#include "attn/cuda/ptx.cuh"

namespace dsv4::cuda::ix {

constexpr int kQTileBytes = kHeads * 128;  // one token's query heads, 128 bytes each

// Shared memory of a CTA with kW warpgroups and groups of up to kMaxG tokens.
template <int kW, int kMaxG>
struct Misc {
  int unit;
  uint32_t bad_tokens;               // bit tl: some head of token tl fails the fast path's checks
  int out_count;
  int tok_t[kMaxG];                  // global token index
  int tok_n[kMaxG];                  // visible keys
  int count[kW][kMaxG];              // candidates in each buffer
  uint64_t tau[kW][kMaxG];           // threshold: candidates must beat it (0: none yet)
  uint32_t sel[kW + 1][2];           // with hist(i): [wg] warpgroup wg's compact, [kW] write_lists
};

// A score kernel's shape: key format, consumer warpgroups, tokens per group;
// and its shared-memory layout (offsets from a 1024-aligned base).
template <bool kFp8_, int kW_, int kMaxG_, int kBufCap_ = 1536, int kStages_ = 4>
struct Shape {
  static constexpr bool kFp8 = kFp8_;
  static constexpr int kW = kW_, kMaxG = kMaxG_, kThreads = 128 * kW_;
  static constexpr int kStages = kStages_;  // tiles in flight per warpgroup
  // Candidates per (warpgroup, token), and per thread when a warpgroup cuts.
  static constexpr int kBufCap = kBufCap_, kBufPerThread = kBufCap_ / 128;
  static_assert(kBufCap % 128 == 0, "buffer split");
  static_assert(kBufCap - kTileKeys >= kIndexerMaxTopk, "a cut must leave room for a step");
  // How MXFP4's integer accumulators become floats (s32_to_float_exact):
  // nibble c is the AccCvt of accumulator 4 i + c. The general shape's
  // busiest pipe is the ALU (65% in run AP2's profile, the XU idle), so one
  // accumulator in four goes to XU: 2% faster scoring, 1.3% off the call on
  // the last 8K chunk of a 64K prefill; one in two scored 2.5% faster but
  // gained only 0.7% on the call. The decode shape (16 warps) keeps I2FP and
  // the magic form alternating: a quarter or half on XU was 1-1.5% slower
  // there (run AP4; earlier, runs AK3, AK5 and AL2).
  static constexpr AccCvt acc_form(int c) { return AccCvt(((kW_ <= 3 ? 0x2111 : 0x1010) >> (4 * c)) & 15); }
  static constexpr int kStageBytes =
      kTileKeys * (indexer_code_bytes(kFp8 ? IndexKeyFormat::kFp8 : IndexKeyFormat::kMxfp4) + kIndexerScaleBytes);
  // write_lists: every buffer's keys over the CTA; a list of up to kIndexerMaxTopk keys sorted.
  static constexpr int kMergePerThread = kW * kBufCap / kThreads;
  static constexpr int kSortPerThread = 4;  // (warps past a short list's end skip the sort's stages)
  // MXFP4 keys in the decode shape: each key's positive and negative codes
  // as two s8 chains, the second against the negated queries (tiles
  // kMaxG + tl), so that the codes' decode needs no sign select (see
  // e2m1x8_split): there it was 36% of the instructions and the tensor pipe
  // 12% busy (run AP7); scoring 5% faster at 128 tokens x 64K (run AQ1).
  // Not in the general shape: its four tokens share a tile's decode, and
  // the negated query tiles (32 KB) leave room for only 1,152 candidates
  // and 3 stages: 13% slower scoring (AQ1).
  static constexpr bool kSplitSigns = !kFp8_ && kMaxG_ == 1;
  static constexpr int kOffQ = 0;
  static constexpr int kOffStage = kOffQ + (kSplitSigns ? 2 : 1) * kMaxG * kQTileBytes;
  static constexpr int kOffBuf = kOffStage + kW * kStages * kStageBytes;
  static constexpr int kOffScores = kOffBuf + kW * kMaxG * kBufCap * 8;
  static constexpr int kOffW = kOffScores + kW * kMaxG * kTileKeys * 4;
  static constexpr int kOffHist = kOffW + kMaxG * 4 * 8 * 4;  // [token][q][i] bf16x2 head weights
  static constexpr int kOffMisc = kOffHist + (kW + 1) * 256 * 4;
  static constexpr int kSmemBytes = kOffMisc + int(sizeof(Misc<kW, kMaxG>)) + 1024;  // + room to align the base
  static_assert(kSmemBytes <= 227 * 1024, "one CTA per SM");
  static_assert(kSortPerThread * kThreads >= kIndexerMaxTopk && kBufCap >= kIndexerMaxTopk, "write_lists' sort");
  static_assert(kMergePerThread * kThreads == kW * kBufCap, "write_lists' merge");
  static_assert(kThreads <= kBufCap, "run_rank_sort_desc pads a buffer to a key a thread");
  static_assert(kMaxG <= 4, "append_tile: a warp of the warpgroup per token");
};
// The general shape runs three warpgroups: at two (8 warps an SM) it issued
// in fewer than half its cycles (run AK7); with MXFP4 keys three score 13%
// faster (AL1). Their shared memory fits at 1,280 candidates a buffer; FP8
// keys' stages are twice the bytes, so they keep three tiles in flight and
// 1,152 candidates (the last 8K chunk of a 64K prefill scores 11% faster
// than at two warpgroups, run AN1). The plan cuts units of at least
// kGeneralMinUnitTiles tiles: a third warpgroup may find none in a unit of two.
template <bool kFp8>
using General = Shape<kFp8, 3, kGroupTokens, kFp8 ? 1152 : 1280, kFp8 ? 3 : 4>;
// Above top-512 (V4-Pro's 1,024) a cut frees less room (FP8 keys' 1,152
// candidates only 64 slots; the top-k took longer than the scoring), so the
// buffers take room from the stages: FP8 keys keep two tiles in flight and
// 1,408 candidates, MXFP4 keys three and 1,536 (runs AO1-AO3 in perf-notes).
template <bool kFp8>
using GeneralWide = Shape<kFp8, 3, kGroupTokens, kFp8 ? 1408 : 1536, kFp8 ? 2 : 3>;
constexpr int kGeneralMaxTopk = 512;  // General's largest top-k; GeneralWide above it
template <bool kFp8>
using Decode = Shape<kFp8, kDecodeWarpgroups, 1>;

template <class C>
struct Smem {
  uint8_t* base;
  __device__ uint64_t* buf(int wg, int tl) const {
    return reinterpret_cast<uint64_t*>(base + C::kOffBuf) + (wg * C::kMaxG + tl) * C::kBufCap;
  }
  __device__ float* scores(int wg, int tl) const {
    return reinterpret_cast<float*>(base + C::kOffScores) + (wg * C::kMaxG + tl) * kTileKeys;
  }
  __device__ uint32_t* wpairs() const { return reinterpret_cast<uint32_t*>(base + C::kOffW); }
  __device__ uint32_t* hist(int i) const { return reinterpret_cast<uint32_t*>(base + C::kOffHist) + 256 * i; }
  __device__ Misc<C::kW, C::kMaxG>* misc() const { return reinterpret_cast<Misc<C::kW, C::kMaxG>*>(base + C::kOffMisc); }
  __device__ uint8_t* stage(int wg, int s) const { return base + C::kOffStage + (wg * C::kStages + s) * C::kStageBytes; }
};

// Byte offset of 16-byte chunk c of row r in a 128-byte-row tile with the
// 128B swizzle wgmma expects (8-row atoms of 1024 bytes).
__device__ __forceinline__ int swz(int r, int c) { return r * 128 + (((c ^ r) & 7) << 4); }

// Exponent bounds of the fast path (see the file comment).
constexpr int kFastExp = 32;
// Head weights: w = 0 or 2^-48 <= |w| <= 2^32. Why 2^-48 is still exact
// (MXFP4): a nonzero dot is at least 2^(Eq + Ek) >= 2^-64, so a nonzero
// term bf16(bf16(dot) * w) is at least 2^-112 and a multiple of 2^-119;
// every partial sum is then a multiple of 2^-119, a normal float when it is
// not zero, on the CPU's side and (scaled by 2^-Ek) on ours, and both round
// alike (the bound holds to 2^-55). FP8 keys' dots are at least 2^-82 on the
// CPU's side, whose sums may go subnormal below ~2^-37 weights; our side stays
// normal there, and FP8 scores match only within the tensor cores' rounding
// anyway. (At 2^-32, one of the 350 million head weights of a 256K prefill's
// C4A layers fell outside, and its group's exact scores cost 2 s: run AM1.)
constexpr float kFastWeightMin = 0x1p-48f;
__device__ __forceinline__ bool weight_ok(float w) {
  const float a = fabsf(w);
  return a == 0.0f || (a >= kFastWeightMin && a <= 0x1p32f);
}

// The fold of one MXFP4 record from its scale word and which blocks hold a
// nonzero code: the smallest exponent among those blocks and whether the
// fast path can take it; fold_shift gives each block's shift above it.
struct Fold {
  int emin;
  bool ok;
};
// The fold from the used blocks' smallest and largest exponents (lo > hi:
// no block used) and whether some block's scale byte is NaN. Written without
// branches (as are its callers): it feeds the A fragments, and a divergent
// branch there makes ptxas serialize the wgmma chains.
__device__ __forceinline__ Fold fold_of(int lo, int hi, bool nan) {
  const bool none = hi < lo;  // all codes zero: any exponent; Eq = 0
  lo = none ? 1 : lo;
  hi = none ? 1 : hi;
  return Fold{lo, bool(!nan & (hi - lo <= 3) & (lo - 1 >= -kFastExp) & (lo - 1 <= kFastExp))};
}
// A block's shift above the fold's smallest exponent (0 for an unused block).
__device__ __forceinline__ int block_shift(int e, int emin, bool used) { return used ? min(max(e - emin, 0), 3) : 0; }

__device__ __forceinline__ Fold mxfp4_fold(uint32_t scale_word, uint32_t nonzero) {
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
  return fold_of(lo, hi, nan);
}
// An FP8 record's scale: a positive normal power of two with a small exponent.
__device__ __forceinline__ bool fp8_scale_ok(float s, int& exponent) {
  const uint32_t u = __float_as_uint(s);
  exponent = int(u >> 23) - 127;
  return (u & 0x807fffffu) == 0 && exponent >= -kFastExp && exponent <= kFastExp;
}

// Block b's shift (b may vary by lane: no array, which would live in local memory).
__device__ __forceinline__ int fold_shift(const Fold& f, uint32_t scale_word, uint32_t nonzero, int b) {
  return block_shift(int((scale_word >> (8 * b)) & 0xffu) - 127, f.emin, ((nonzero >> b) & 1u) != 0);
}

__device__ __forceinline__ uint32_t nonzero_e2m1(uint32_t w) { return (w & 0x77777777u) != 0 ? 1u : 0u; }

// mxfp4_fold and fold_shift for a key row whose four blocks are held by a
// quad of lanes (lane q: block q; `used`: its codes are not all zero): the
// smallest and largest used exponents from two rounds of shuffles. (With
// mxfp4_fold, every lane of the quad folded the whole record: about 45
// instructions a row, where this takes about 20.)
struct QuadFold {
  int emin, shift;  // Fold::emin; this lane's block shift
  bool ok;          // Fold::ok
};
__device__ __forceinline__ QuadFold quad_fold(uint32_t scale_word, bool used, int q) {
  const int e = int((scale_word >> (8 * q)) & 0xffu) - 127;
  // Some block's scale byte is 0xff (NaN): its low 7 bits + 1 carry into bit 7.
  const bool nan = (((scale_word & 0x7f7f7f7fu) + 0x01010101u) & scale_word & 0x80808080u) != 0;
  int lo = used ? e : 1000, hi = used ? e : -1000;
#pragma unroll
  for (int o = 1; o <= 2; o <<= 1) {
    lo = min(lo, __shfl_xor_sync(0xffffffffu, lo, o));
    hi = max(hi, __shfl_xor_sync(0xffffffffu, hi, o));
  }
  const Fold f = fold_of(lo, hi, nan);
  return QuadFold{f.emin, block_shift(e, f.emin, used), f.ok};
}

// 2^e for the fast path's exponents (|e| <= kFastExp; others are clamped:
// their scores are overwritten by the exact path), without exp2_int's branches.
__device__ __forceinline__ float pow2_fast(int e) {
  return __int_as_float((min(max(e, -kFastExp), kFastExp) + 127) << 23);
}

// ---- the unit's queries --------------------------------------------------------
// P = kThreads / (64 kMaxG) threads per query head: thread (tl, h, part) =
// (tid / (64 P), tid / P % 64, tid % P) writes chunks part, part + P, .. of B row h of token
// tl, where chunk c word qq holds dims 32 qq + 4 c .. + 3 (the permuted K
// order of the A fragments, see score_tile); part 0 also writes the head's w''
// into the weight pairs. (The decode shape has 8 threads per head: with one
// per head, 2 of its 16 warps converted the queries while the others waited.)
template <class C>
__device__ void load_queries(const IndexerSelectParams& p, const Smem<C>& s, const Group& gr) {
  constexpr bool kFp8 = C::kFp8;
  // threads per query head: a power of two (three warpgroups: 1, and the
  // last 128 threads load nothing)
  constexpr int P0 = C::kThreads / (kHeads * C::kMaxG);
  constexpr int P = P0 >= 8 ? 8 : P0 >= 4 ? 4 : P0 >= 2 ? 2 : 1;
  static_assert(P >= 1 && 8 % P == 0 && P * kHeads * C::kMaxG <= C::kThreads, "threads per query head");
  auto* m = s.misc();
  const int tid = threadIdx.x, tl = tid / (kHeads * P), h = tid / P % kHeads, part = tid % P;
  bool ok = true;
  if (tl < min(gr.count, C::kMaxG)) {
    const int t = gr.first + tl;
    const int64_t e = int64_t(t) * kHeads + h;
    uint8_t* row = s.base + C::kOffQ + tl * kQTileBytes;
    int eq = 0;
    if constexpr (kFp8) {
      const uint4* rec = reinterpret_cast<const uint4*>(p.queries.codes + e * kIndexDim);
#pragma unroll
      for (int j = 0; j < 8 / P; ++j) {
        const int c = part + P * j;  // word qq: word 8 qq + c of the record, in its 16-byte piece 2 qq + c / 4
        uint32_t o[4];
#pragma unroll
        for (int qq = 0; qq < 4; ++qq) o[qq] = word_of(__ldg(rec + 2 * qq + (c >> 2)), c & 3);
        *reinterpret_cast<uint4*>(row + swz(h, c)) = make_uint4(o[0], o[1], o[2], o[3]);
      }
      const float qs = __ldg(reinterpret_cast<const float*>(p.queries.scales + e * kIndexerScaleBytes));
      ok = fp8_scale_ok(qs, eq);
    } else {
      const uint4* rec = reinterpret_cast<const uint4*>(p.queries.codes + e * (kIndexDim / 2));
      uint4 v[4];
      uint32_t nonzero = 0;
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        v[i] = __ldg(rec + i);
        nonzero |= (nonzero_e2m1(v[i].x | v[i].y | v[i].z | v[i].w)) << i;  // block i = 16 bytes
      }
      const uint32_t sw = __ldg(reinterpret_cast<const uint32_t*>(p.queries.scales + e * kIndexerScaleBytes));
      const Fold f = mxfp4_fold(sw, nonzero);
      ok = f.ok;
      eq = f.emin - 1;
#pragma unroll
      for (int j = 0; j < 8 / P; ++j) {
        const int c = part + P * j;
        uint32_t o[4], n[4];
#pragma unroll
        for (int qq = 0; qq < 4; ++qq) {
          // dims 32 qq + 4 c .. + 3: bytes 16 qq + 2 c, + 1 of the record
          const uint32_t word = word_of(v[qq], c >> 1), half = (c & 1) ? (word >> 16) : (word & 0xffffu);
          const int shift = fold_shift(f, sw, nonzero, qq);
          o[qq] = e2m1x4_to_s8(half, shift);
          if constexpr (C::kSplitSigns) n[qq] = e2m1x4_to_s8(half ^ 0x8888u, shift);  // -q: every sign flipped
        }
        *reinterpret_cast<uint4*>(row + swz(h, c)) = make_uint4(o[0], o[1], o[2], o[3]);
        if constexpr (C::kSplitSigns)
          *reinterpret_cast<uint4*>(row + C::kMaxG * kQTileBytes + swz(h, c)) = make_uint4(n[0], n[1], n[2], n[3]);
      }
    }
    const float w = __ldg(p.queries.weights + e);
    ok = ok && weight_ok(w);
    if (part == 0) {
      const float w2 = __fmul_rn(w, pow2_fast(eq));  // exact when ok
      reinterpret_cast<uint16_t*>(s.wpairs())[((tl * 4 + ((h & 7) >> 1)) * 8 + (h >> 3)) * 2 + (h & 1)] =
          bf16_bits(w2);
    }
    if (h == 0 && part == 0) {
      m->tok_t[tl] = t;
      m->tok_n[tl] = int(indexer_visible(p.positions[t]));
    }
  }
  if (tid < C::kW * C::kMaxG) {
    m->count[tid / C::kMaxG][tid % C::kMaxG] = 0;
    m->tau[tid / C::kMaxG][tid % C::kMaxG] = 0;
  }
  fence_proxy_async();  // generic writes of B, read by wgmma (async proxy)
  // Which tokens fail a check: only their scores take the exact path. (With
  // one flag for the group, its other tokens went there too: a 256K
  // prefill's chunk with one such group took 2.55 s of indexer time, 1.73 s
  // with a flag a token, 0.40 s with the group on the fast path, runs AM1-AM2.)
  uint32_t bad = 0;
#pragma unroll
  for (int u = 0; u < C::kMaxG; ++u) bad |= uint32_t(__syncthreads_or(!ok && tl == u)) << u;
  if (tid == 0) m->bad_tokens = bad;
  __syncthreads();
}

// ---- keys: cp.async of one page into a stage ----------------------------------------
struct TileRef {
  const uint8_t* page;  // null: no page (the tile has no keys)
};
// The pages of a run's tiles: its row of the C4A block table, whose first
// column is read once per unit (not once per tile, on the tile's critical path).
struct RunPages {
  const int32_t* row;
  int64_t first;  // tile of column 0
  int width;
  KvPages keys;
  __device__ RunPages(const IndexerSelectParams& p, int run)
      : row(p.c4a_table.pages + int64_t(run) * p.c4a_table.width), first(p.c4a_table.first[run]),
        width(p.c4a_table.width), keys(p.keys) {}
  __device__ TileRef operator()(int tile) const {
    const int64_t col = int64_t(tile) - first;
    int32_t page = -1;
    if (col >= 0 && col < width) page = row[col];
    return TileRef{page >= 0 && page < keys.num_pages ? keys.page(page) : nullptr};
  }
};

// Stage layout = the page's: codes of rows 0..63, then their 4 scale bytes.
// Rows at or beyond `rows` (the tile's keys some token sees) are zero filled
// without a read (`dummy`, any global address, stands in for their source).
template <class C>
__device__ __forceinline__ void issue_tile(const TileRef& ref, uint8_t* stage, int rows, int wt, const void* dummy) {
  constexpr int kCode = C::kFp8 ? kIndexDim : kIndexDim / 2;
  constexpr int kChunks = C::kStageBytes / 16, kRowChunks = kCode / 16, kCodeChunks = kTileKeys * kRowChunks;
  const uint32_t dst = smem_u32(stage);
#pragma unroll
  for (int i = 0; i < (kChunks + 127) / 128; ++i) {
    const int c = wt + 128 * i;
    if (c >= kChunks) break;
    const bool valid = ref.page != nullptr && (c >= kCodeChunks || c / kRowChunks < rows);
    cp_async_16(dst + 16 * c, valid ? static_cast<const void*>(ref.page + 16 * c) : dummy, valid ? 16u : 0u);
  }
}

// ---- epilogue ----------------------------------------------------------------------
// Scores of rows g and g + 8 of this warp for one token (all four lanes of a
// quad return them): see step 3 of the file comment.
template <class C, typename Acc>
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
        x[c] = s32_to_float_exact(uint32_t(acc[4 * i + c]), C::acc_form(c));
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
  indexer_finish2(p0, p1, s0, s1);
}

// The exact scalar path for one tile: the CPU twin's arithmetic per (token,
// key), into the score slots of the tokens in `tokens` (bit tl). With one
// token two threads share a pair, each two of IndexerHeadSum's four partial
// sums (heads h with (h & 7) >> 2 == half), added in its order.
template <class C>
__device__ void tile_exact(const IndexerSelectParams& p, const Smem<C>& s, const uint8_t* stage, int wg, int wt,
                           uint32_t tokens, int64_t j0) {
  constexpr bool kFp8 = C::kFp8;
  constexpr int kCode = kFp8 ? kIndexDim : kIndexDim / 2;
  const auto* m = s.misc();
  const int n = __popc(tokens), halves = n == 1 ? 2 : 1, pairs = n * kTileKeys;
  for (int base = 0; base < pairs * halves; base += 128) {  // (uniform: the shuffle below)
    const int idx = base + wt, pair = idx / halves, half = idx % halves;
    // the (pair / kTileKeys)-th token of the mask (__fns counts from 1)
    const int tl = pair < pairs ? int(__fns(tokens, 0, pair / kTileKeys + 1)) : 0;
    const int r = pair % kTileKeys;
    const bool live = pair < pairs && j0 + r < m->tok_n[tl];
    IndexerHeadSum hs;
    if (live) {
      const uint8_t* kc = stage + r * kCode;
      const uint8_t* ks = stage + kTileKeys * kCode + r * kIndexerScaleBytes;
      const int64_t e0 = int64_t(m->tok_t[tl]) * kHeads;
      // (Heads by eights, unrolled within: the partial a head adds to is then
      // known to the compiler, and hs.p stays in registers, not local memory.)
      for (int h8 = 0; h8 < kHeads; h8 += 8) {
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          if (halves == 2 && (i >> 2) != half) continue;
          const int h = h8 + i;
          const uint8_t* qc = p.queries.codes + (e0 + h) * kCode;
          const uint8_t* qs = p.queries.scales + (e0 + h) * kIndexerScaleBytes;
          float v;
          if constexpr (kFp8)
            v = fp8_dot_exact(qc, *reinterpret_cast<const float*>(qs), kc, *reinterpret_cast<const float*>(ks));
          else
            v = indexer_mxfp4_dot(qc, qs, kc, ks);
          hs.add(i, indexer_term(v, p.queries.weights[e0 + h]));
        }
      }
    }
    float total = hs.total();
    if (halves == 2) {  // the halves' sums in lanes idx, idx ^ 1 (their sum is total()'s)
      const float mine = hs.half(half);
      total = mine + __shfl_xor_sync(0xffffffffu, mine, 1);
    }
    if (live && half == 0) s.scores(wg, tl)[r] = indexer_finish(total);
  }
}

__device__ __forceinline__ void wg_sync(int wg) { bar_sync(1 + wg, 128); }

// ---- one tile of a warpgroup ----------------------------------------------------------
// kG tokens' wgmma chains on the tile in `stage`, the scores of
// token tl into score slot tl. kG is a template parameter so that no branch
// depends on it while a wgmma chain is in flight (ptxas would serialize the
// chains). rows: the tile's keys some token of the group sees (rows at or
// past it were not read). Returns whether this thread's keys pass the fast
// path's checks.
template <class C, int kG>
__device__ bool score_tile(const Smem<C>& s, const uint8_t* stage, int wg, int rows) {
  constexpr bool kFp8 = C::kFp8;
  constexpr int kCode = kFp8 ? kIndexDim : kIndexDim / 2;
  const int wt = threadIdx.x & 127, warp = wt >> 5, lane = wt & 31, g = lane >> 2, q = lane & 3;
  const int r0 = 16 * warp + g, r1 = r0 + 8;
  const bool valid0 = r0 < rows, valid1 = r1 < rows;
  // This lane's 32 elements of each of its two rows (bytes 16 q.. of an MXFP4
  // row = block q; bytes 32 q.. of an FP8 row) and the rows' scales.
  uint32_t w0[kFp8 ? 8 : 4], w1[kFp8 ? 8 : 4];
#pragma unroll
  for (int i = 0; i < (kFp8 ? 2 : 1); ++i) {
    const uint4 x = *reinterpret_cast<const uint4*>(stage + r0 * kCode + (kFp8 ? 32 : 16) * q + 16 * i);
    const uint4 y = *reinterpret_cast<const uint4*>(stage + r1 * kCode + (kFp8 ? 32 : 16) * q + 16 * i);
    w0[4 * i] = x.x, w0[4 * i + 1] = x.y, w0[4 * i + 2] = x.z, w0[4 * i + 3] = x.w;
    w1[4 * i] = y.x, w1[4 * i + 1] = y.y, w1[4 * i + 2] = y.z, w1[4 * i + 3] = y.w;
  }
  const uint32_t sc0 = *reinterpret_cast<const uint32_t*>(stage + kTileKeys * kCode + r0 * kIndexerScaleBytes);
  const uint32_t sc1 = *reinterpret_cast<const uint32_t*>(stage + kTileKeys * kCode + r1 * kIndexerScaleBytes);
  int ek0 = 0, ek1 = 0, shift0 = 0, shift1 = 0;
  bool ok;
  if constexpr (kFp8) {
    const bool ok0 = fp8_scale_ok(__uint_as_float(sc0), ek0), ok1 = fp8_scale_ok(__uint_as_float(sc1), ek1);
    ok = (!valid0 | ok0) & (!valid1 | ok1);
  } else {
    // Lanes 4 g .. 4 g + 3 hold blocks 0..3 of both rows.
    const QuadFold f0 = quad_fold(sc0, nonzero_e2m1(w0[0] | w0[1] | w0[2] | w0[3]) != 0, q);
    const QuadFold f1 = quad_fold(sc1, nonzero_e2m1(w1[0] | w1[1] | w1[2] | w1[3]) != 0, q);
    ek0 = f0.emin - 1;
    ek1 = f1.emin - 1;
    shift0 = f0.shift;
    shift1 = f1.shift;
    ok = (!valid0 | f0.ok) & (!valid1 | f1.ok);
  }
  // A fragments: k-step st takes word st (MXFP4: 8 codes) or words 2 st, 2 st + 1 (FP8);
  // an: the negative codes' magnitudes (C::kSplitSigns).
  uint32_t a[4][4], an[C::kSplitSigns ? 4 : 1][4];
#pragma unroll
  for (int st = 0; st < 4; ++st) {
    if constexpr (C::kSplitSigns) {
      const E2m1Table tab0 = e2m1_table(shift0), tab1 = e2m1_table(shift1);  // (hoisted: the loop unrolls)
      e2m1x8_split(w0[st], tab0, a[st][0], a[st][2], an[st][0], an[st][2]);
      e2m1x8_split(w1[st], tab1, a[st][1], a[st][3], an[st][1], an[st][3]);
    } else if constexpr (kFp8) {
      a[st][0] = w0[2 * st];
      a[st][1] = w1[2 * st];
      a[st][2] = w0[2 * st + 1];
      a[st][3] = w1[2 * st + 1];
    } else {
      const E2m1Table tab0 = e2m1_table(shift0), tab1 = e2m1_table(shift1);  // (hoisted: the loop unrolls)
      e2m1x8_to_s8(w0[st], tab0, a[st][0], a[st][2]);
      e2m1x8_to_s8(w1[st], tab1, a[st][1], a[st][3]);
    }
  }
  // Materialize the fragments here: left to the scheduler, the conversions
  // sink between the wgmmas and ptxas must insert fences there.
#pragma unroll
  for (int st = 0; st < 4; ++st)
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      asm volatile("" : "+r"(a[st][i]));
      if constexpr (C::kSplitSigns) asm volatile("" : "+r"(an[st][i]));
    }
  const float kscale0 = pow2_fast(ek0), kscale1 = pow2_fast(ek1);
  const uint32_t qbase = smem_u32(s.base + C::kOffQ);
  // Token tl + 1's chain runs while token tl's epilogue does (two accumulator sets).
  using Acc = std::conditional_t<kFp8, float, uint32_t>;
  Acc acc0[32], acc1[32];
  auto issue = [&](int tl, Acc(&acc)[32]) {  // (the first step overwrites acc)
    const uint64_t db = sw128_desc(qbase + tl * kQTileBytes, 16, 1024);
    wgmma_fence();
    if constexpr (kFp8) {
      wgmma_e4m3_rs<0>(acc, a[0], db);
      wgmma_e4m3_rs<1>(acc, a[1], db + 2);  // + 32 bytes per k-step (descriptor units of 16)
      wgmma_e4m3_rs<1>(acc, a[2], db + 4);
      wgmma_e4m3_rs<1>(acc, a[3], db + 6);
    } else {
      wgmma_s8_rs<0>(acc, a[0], db);
      wgmma_s8_rs<1>(acc, a[1], db + 2);
      wgmma_s8_rs<1>(acc, a[2], db + 4);
      wgmma_s8_rs<1>(acc, a[3], db + 6);
      if constexpr (C::kSplitSigns) {  // the negative codes against -q: the same integer sum
        const uint64_t dn = sw128_desc(qbase + (C::kMaxG + tl) * kQTileBytes, 16, 1024);
        wgmma_s8_rs<1>(acc, an[0], dn);
        wgmma_s8_rs<1>(acc, an[1], dn + 2);
        wgmma_s8_rs<1>(acc, an[2], dn + 4);
        wgmma_s8_rs<1>(acc, an[3], dn + 6);
      }
    }
    wgmma_commit();
  };
  issue(0, acc0);
#pragma unroll
  for (int tl = 0; tl < kG; ++tl) {
    Acc(&cur)[32] = (tl & 1) ? acc1 : acc0;
    if (tl + 1 < kG) {
      issue(tl + 1, (tl & 1) ? acc0 : acc1);
      wgmma_wait<1>();  // token tl's chain is done, tl + 1's may run on
    } else {
      wgmma_wait<0>();
    }
    fence_acc(cur);
    float s0, s1;
    tile_epilogue<C>(cur, s.wpairs() + (tl * 4 + q) * 8, s0, s1);
    // Every lane of the quad holds both scores: all store (no divergent
    // branch while the next chain is in flight).
    float* out = s.scores(wg, tl);
    out[r0] = __fmul_rn(s0, kscale0);
    out[r1] = __fmul_rn(s1, kscale1);
  }
  return ok;
}

// Cuts a warpgroup's buffer of one token to its best k (and up to slack
// more); raises the threshold.
template <class C>
__device__ void compact(const Smem<C>& s, int wg, int tl, int k) {
  const int wt = threadIdx.x & 127, lane = wt & 31;
  auto* m = s.misc();
  uint64_t* buf = s.buf(wg, tl);
  const int n = m->count[wg][tl];
  constexpr int kBufPerThread = C::kBufPerThread;
  uint64_t keys[kBufPerThread];
#pragma unroll
  for (int i = 0; i < kBufPerThread; ++i) keys[i] = wt + 128 * i < n ? buf[wt + 128 * i] : 0;
  // Keeps k to k + slack keys, slack a quarter of the room a cut could free:
  // the radix passes stop at the first digit whose bin at the k-th key is
  // small enough (each pass costs three barriers), for a little less room
  // (the last 8K chunk of a 64K prefill scores 1.4-4.3% faster, run AO2).
  const uint32_t slack = uint32_t(C::kBufCap - kTileKeys - k) / 4;
  const uint64_t cut = radix_kth<8, false>(
      [&](auto&& f) {
#pragma unroll
        for (int i = 0; i < kBufPerThread; ++i) f(keys[i]);
      },
      uint32_t(k), s.hist(wg), m->sel[wg], wt, 128, [&] { wg_sync(wg); }, slack);
  if (wt == 0) {
    m->count[wg][tl] = 0;
    m->tau[wg][tl] = cut;
  }
  wg_sync(wg);
#pragma unroll
  for (int i = 0; i < kBufPerThread; ++i) warp_append(keys[i] >= cut, keys[i], buf, &m->count[wg][tl], lane);
  wg_sync(wg);
}

// Appends the keys of the tile at j0 that beat their token's threshold to
// the warpgroup's buffers. With groups of several tokens (the general
// shape) warp w takes token w's keys: a buffer then has one writer between
// the tile's barriers, so its count is a register, not a shared atomic a
// warp waits for (the last 8K chunk of a 64K prefill scores 3-5% faster,
// run AO4). With one token (decode) two warps share its 64 keys through
// the atomic: one warp for all of them was 3-6% slower there.
template <class C, int kG>
__device__ void append_tile(const Smem<C>& s, int wg, int64_t j0) {
  const int wt = threadIdx.x & 127, lane = wt & 31;
  auto* m = s.misc();
  if constexpr (C::kMaxG == 1) {
    const int64_t j = j0 + wt;
    const uint64_t key = wt < kTileKeys && j < m->tok_n[0] ? indexer_order_key(s.scores(wg, 0)[wt], j) : 0;
    warp_append(key > m->tau[wg][0], key, s.buf(wg, 0), &m->count[wg][0], lane);  // (a key is never 0)
  } else {
    const int tl = wt >> 5;
    if (tl >= kG) return;
    const int64_t n = m->tok_n[tl];
    const uint64_t tau = m->tau[wg][tl];
    const float* scores = s.scores(wg, tl);
    uint64_t* buf = s.buf(wg, tl);
    int count = m->count[wg][tl];
#pragma unroll
    for (int h = 0; h < kTileKeys / 32; ++h) {
      const int r = 32 * h + lane;
      const int64_t j = j0 + r;
      const uint64_t key = j < n ? indexer_order_key(scores[r], j) : 0;
      const bool take = key > tau;
      const uint32_t ballot = __ballot_sync(0xffffffffu, take);
      if (take) buf[count + __popc(ballot & ((1u << lane) - 1u))] = key;
      count += __popc(ballot);
    }
    if (lane == 0) m->count[wg][tl] = count;
  }
}

// A warpgroup's tiles of the unit: tile_begin + wg, + kW, ...
template <class C, bool kSelect, int kG>
__device__ void consume(const IndexerSelectParams& p, const Smem<C>& s, const Group& gr, const Unit& un) {
  const int wg = threadIdx.x >> 7, wt = threadIdx.x & 127;
  auto* m = s.misc();
  constexpr int kStages = C::kStages;
  int n_max = 0;  // the group's most visible keys
  for (int tl = 0; tl < kG; ++tl) n_max = max(n_max, m->tok_n[tl]);
  const int first = un.tile_begin + wg;
  const int mine = first < un.tile_end ? (un.tile_end - first + C::kW - 1) / C::kW : 0;
  auto tile_of = [&](int i) { return first + C::kW * i; };
  auto rows_of = [&](int i) { return min(max(n_max - tile_of(i) * kTileKeys, 0), kTileKeys); };
  const RunPages pages(p, gr.run);
  // Lane l of each warp holds the page of tile 32 b + l, looked up (block
  // table load, bounds checks, address) for 32 tiles at once when tile 32 b
  // is issued; a tile's issue then shuffles its page from its lane. Looked
  // up per tile, the dependent load and its 64-bit checks were most of the
  // decode scorer's 82 loop-top instructions a tile (run AQ4); batched, the
  // decode scorer scores 9% faster, the prefill scorer 3% (AQ5).
  const int lane = wt & 31;
  uintptr_t lane_page = 0;
  // Bit kStages - 1 - d says whether the tile issued d tiles after tile i
  // has a page, so that each tile's page is looked up once.
  uint32_t has_page = 0;
  auto issue = [&](int i) {  // one commit group per tile, empty past the last (i: 0, 1, ... in turn)
    bool page = false;
    if (i < mine) {
      if ((i & 31) == 0) lane_page = i + lane < mine ? uintptr_t(pages(tile_of(i + lane)).page) : 0;
      const TileRef ref{reinterpret_cast<const uint8_t*>(__shfl_sync(0xffffffffu, lane_page, i & 31))};
      page = ref.page != nullptr;
      issue_tile<C>(ref, s.stage(wg, i % kStages), rows_of(i), wt, p.queries.codes);
    }
    has_page = (has_page << 1) | uint32_t(page);
    cp_async_commit();
  };
  for (int i = 0; i < kStages - 1; ++i) issue(i);
  for (int i = 0; i < mine; ++i) {
    issue(i + kStages - 1);
    cp_async_wait_group<kStages - 1>();  // this thread's copies of tile i have landed
    wg_sync(wg);                         // and everyone's; the last tile's appends are done
    if constexpr (kSelect)
      for (int tl = 0; tl < kG; ++tl)  // cut when another tile might not fit
        if (m->count[wg][tl] > C::kBufCap - kTileKeys) compact(s, wg, tl, p.topk);
    if (((has_page >> (kStages - 1)) & 1u) == 0) continue;  // no page: no keys (uniform)
    const int64_t j0 = int64_t(tile_of(i)) * kTileKeys;
    const bool ok = score_tile<C, kG>(s, s.stage(wg, i % kStages), wg, rows_of(i));
    // The scores are visible after this barrier, which also tells whether any
    // key of the tile is outside the fast path's range. The exact path then
    // overwrites the scores of every token (a key outside) or of the tokens
    // outside it. (After the chains, not around them: a wgmma under a
    // data-dependent branch makes ptxas serialize the chains.)
    const uint32_t exact = bar_red_or(!ok, 1 + wg, 128) ? (1u << kG) - 1 : m->bad_tokens & ((1u << kG) - 1);
    if (exact != 0) {
      tile_exact(p, s, s.stage(wg, i % kStages), wg, wt, exact, j0);
      wg_sync(wg);
    }
    // (A full buffer is cut after the next tile's barrier, which orders
    // these appends: one barrier a tile fewer.)
    if constexpr (kSelect) append_tile<C, kG>(s, wg, j0);
  }
  cp_async_wait_group<0>();
}

}  // namespace dsv4::cuda::ix
