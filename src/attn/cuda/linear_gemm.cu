// The FP8 linears' wgmma GEMM for up to 128 activation rows (Fp8Linear
// between the small-M kernel and cuBLASLt; LinearOptions::gemm_from and
// gemm_max; the layer takes it for 1-64 rows, cuda_layer.cu).
//
// Why our own: cuBLASLt's block-scaled FP8 kernels run these decode-batch
// shapes at 1.6-2.7x their weight bytes (docs/perf-notes.md, runs Q1-Q2),
// and the kernel after them cannot start before they end (they take no part
// in programmatic dependent launch). Here the weight, which no kernel
// writes, is in flight before the PDL wait.
//
// A CTA owns 128 weight rows (one row block of the 128x128 weight scales;
// warpgroup g the rows 64 (g % 2) .. 64 (g % 2) + 63) and a slice of k
// (split-K: blockIdx.x, row block: blockIdx.y). The tokens are the
// wgmma's N (8, 16, 32, 64 or 128, zero rows past m), the weight its M: the
// weight tile is A, the activation tile B, both e4m3 K-major in shared
// memory with the 128-byte swizzle, one 128-wide k block per stage, loaded
// by every thread with 16-byte cp.async into a ring of stages. The copies of
// a stage are issued while the wgmmas of an earlier one run. The weight's
// copies take the L2 evict-first policy: with the default one the kernels
// after this one ended later, by about what it gained on the small-M kernel
// (batch-1 step 3.56 ms on the small-M kernel, 3.74-4.04 on this one, 3.30
// with the policy; docs/perf-notes.md, runs T2 and U1-U2). Tiles of up to
// 64 tokens fit two CTAs per SM, so one CTA's promotion and barriers overlap
// the other's MMAs; 128 tokens take one CTA of four warpgroups (two along
// the tokens), the same 16 warps per SM.
//
// Split-K runs in a thread-block cluster: the splits of a row block are one
// cluster, each leaves its partial tile in its own shared memory, and each
// then sums its share of the token rows over the cluster's tiles (DSMEM, in
// split order 0..S-1) and writes them. Nothing goes through global memory
// and no counter is needed; the sums are the same bits on every run. Decode
// rows whose clusters would not all be resident (global_sum,
// gemm_choose_splits) instead leave their tiles in the workspace and the
// last CTA of a row block to arrive sums them, in the same fixed order, as
// the small-M kernel does.
//
// Numerics: each 128-k block is one chain of four m64nNk32 wgmmas into
// fresh accumulators, then scaled by sx(token, kb) * sw(kb) into the fp32
// running sums (DeepSeek-V3's promotion: Hopper's FP8 MMA keeps fewer
// accumulator bits, about 14, inside a chain). The same class of error as
// cuBLASLt's block-scaled FP8 product (the tests' bound 2^-11 sum|xw|).
// Tiles of up to 16 tokens (decode steps) promote every 32 k instead: four
// one-wgmma chains into their own registers, so shorter runs of truncated
// adds, for a few registers more (with wq_a+wkv on it the golden's kv p99
// went 1.10e-2 -> 6.9e-3, docs/perf-notes.md runs T1-T2).
//
// Up to 8 rows it can end with wq_b's q-head tail (GemvQHeadTail, as the
// small-M kernel does): the last CTA to write a head norms and rotates it;
// or with wo_b's residual tail (GemvResidualTail): the residual add and the
// next layer's norm, by the CTAs that wrote the output, after a barrier
// among them.
//
// wo_a (kW8A16: FP8 weight x bf16 activation) runs the same
// ring with a bf16 activation tile and bf16 wgmmas whose A comes from
// registers: each thread reads its weight rows 16 bytes at a time from the
// stage and decodes them exactly into bf16 fragments (the small-M kernel's
// decoder: bits times 2^-120, one exact multiply by 2^120). A 16-byte read
// holds 16 consecutive k of which each wgmma step takes four, so the k order
// inside a 128-k block is permuted; the MMA only needs A and B to agree, and
// the activation's 4-byte pairs are copied into the permuted places
// (w8a16_pair_offset). Each 128-k block is eight m64nNk16 wgmmas (two
// alternating chains up to 16 tokens, one from 32), scaled by sw(kb) into
// the running sums (bf16 products are exact and their sums fp32); the output
// tile can also be quantized to FP8 in the cluster's write (wo_b's input),
// as the small-M kernel does. Its 64- and 128-token tiles run one CTA an SM
// (32 and 48 KB stages; 154 and 208 registers). Decoding block kb + 1 while
// block kb's wgmmas run (two fragment sets, the scale folded into the
// decode) made every tile slower, 8-32 tokens by 0.5-1.2 us
// (docs/perf-notes.md, run BF2). The pairs' copy addresses are set up once a
// thread and walked (x_even, x_odd, x_row0): recomputed for each copy, they
// took over half of the 128-token tile's instructions. Walked, wo_a at 64,
// 96 and 128 rows took 22.2, 29.5 and 33.2 us against 23.5, 36.8 and 38.1
// (H100, docs/perf-notes.md runs BG1-BG4).
#include <cuda_runtime.h>

#include <cstdint>

#include "attn/cuda/linear_gemv.cuh"
#include "attn/cuda/ptx.cuh"
#include "attn/cuda/wgmma_e4m3.cuh"
#include "common/error.h"

namespace dsv4::cuda::detail {
namespace {

constexpr int kATileBytes = kGemvCtaRows * 128;  // 128 weight rows of one 128-k block
static_assert(kGemvCtaRows == 128, "warpgroups of 64 weight rows");
constexpr int kGemmMaxSplits = 8;                // a portable cluster

// NT (8-64) tokens: two warpgroups (64 weight rows each) of NT tokens, two
// CTAs per SM; 128 FP8 tokens: four warpgroups (64 rows x 64 tokens each),
// one CTA. W: kFp8 (e4m3 activation, FP8 wgmma) or kW8A16 (bf16 activation),
// whose 64- and 128-token tiles are two warpgroups of NT tokens in one CTA
// an SM: a stage of them is 32 or 48 KB, and each warpgroup decodes its
// weight rows once for all its tokens. (Four warpgroups of 64 tokens, as the
// FP8 tile, decode every weight twice and spill at 128 registers: 60 against
// 38 us for wo_a at 128 rows, docs/perf-notes.md run BF5.)
template <int NT, GemvWeight W = GemvWeight::kFp8>
struct GemmTile {
  static constexpr bool kBf16X = W == GemvWeight::kW8A16;  // bf16 activation, A from registers
  static constexpr int kTokenGroups = NT == 128 && !kBf16X ? 2 : 1;  // warpgroups along the tokens
  static constexpr int kThreads = 256 * kTokenGroups;
  static constexpr int kWgTokens = NT / kTokenGroups;     // the wgmma's N
  static constexpr int kCtasPerSm = NT <= (kBf16X ? 32 : 64) ? 2 : 1;
  static constexpr int kRingBudget = kCtasPerSm == 2 ? 98304 : 196608;
  static constexpr int kBBytes = NT * 128 * (kBf16X ? 2 : 1);  // NT tokens of one 128-k block
  static constexpr int kXScales = kBf16X ? 0 : NT;  // activation scales per stage
  static constexpr int kStageBytes = kATileBytes + kBBytes;
  static constexpr int kStages = kRingBudget / kStageBytes < 8 ? kRingBudget / kStageBytes : 8;
  static constexpr int kAcc = kWgTokens / 2;  // fp32 accumulators per thread (m64n kWgTokens)
  static constexpr int kCopyRows = kThreads / 8;  // rows one pass of 16-byte copies covers
  // Ring, then the activation scales [stages][NT] and the weight scales [stages].
  static constexpr size_t kSmemBytes = 1024 + size_t(kStages) * kStageBytes + size_t(kStages) * (kXScales + 1) * 4;
  static_assert(kStages >= 4, "three stages in flight");
  static_assert(NT * kCtStride * 4 <= kStages * kStageBytes, "the output tile reuses the ring");
  // The tails (up to kGemvTailRows tokens) run on 256 threads in the ring.
  static constexpr bool kTails = !kBf16X && NT <= kGemvTailRows;
  // Independent accumulator chains per 128-k block: FP8 tiles of up to 16
  // tokens promote every 32 k; bf16 ones of up to 16 alternate two chains of
  // four wgmmas (half the dependent latency; 32 tokens keep one: 120 of
  // their 128 registers are taken with it).
  static constexpr int kChains = NT <= 16 ? (kBf16X ? 2 : 4) : 1;
  // kW8A16: 4-byte activation pairs per thread and stage (64 a token row).
  static constexpr int kPairCopies = kBf16X ? NT * 64 / kThreads : 0;
  static_assert(kPairCopies * kThreads == (kBf16X ? NT * 64 : 0), "whole token rows per pass");
  static_assert(!kBf16X || kThreads == 256, "a pass covers 4 token rows (the kernel's x_even / x_odd)");
  static_assert(!kTails || (kThreads == kQHeadThreads && sizeof(QHeadSmem) <= kStages * kStageBytes &&
                            kResidualTailSmem <= kStages * kStageBytes));
};

// Sums token row t's 128 columns over the cluster's S tiles (split order)
// and writes them as bf16 (and their FP8 quantization where kMayQuantize
// and asked for): thread `lane` of a 32-thread group takes columns 4 lane ..
// 4 lane + 3.
template <bool kMayQuantize>
__device__ __forceinline__ void write_row(const GemvArgs& a, uint32_t ct, int t, int lane, int splits, int cols) {
  const int c = 4 * lane;
  if (c >= cols) return;
  const float4 v = cluster_sum4(ct + uint32_t(t * kCtStride + c) * 4, splits);
  uint16_t* y = static_cast<uint16_t*>(a.y) + int64_t(t) * a.ldy + int64_t(blockIdx.y) * kGemvCtaRows + c;
  const uint16_t b[4] = {bf16_store(v.x), bf16_store(v.y), bf16_store(v.z), bf16_store(v.w)};
  if (c + 4 <= cols && (reinterpret_cast<uintptr_t>(y) & 7) == 0) {
    *reinterpret_cast<uint2*>(y) = make_uint2(uint32_t(b[0]) | (uint32_t(b[1]) << 16), uint32_t(b[2]) | (uint32_t(b[3]) << 16));
  } else {
    for (int e = 0; e < 4 && c + e < cols; ++e) y[e] = b[e];
  }
  // The host guarantees whole 128-column blocks here, so every lane of the
  // warp is present for the block's amax.
  if (kMayQuantize && a.quantize)
    store_act_block(a.q, t, int(blockIdx.y), {bf16_round(v.x), bf16_round(v.y), bf16_round(v.z), bf16_round(v.w)});
}

// kW8A16: where 4-byte pair pp (0..63, k 2 pp, 2 pp + 1 of a 128-k block) of
// token row n lands in the stage's activation tile. The tile is two 64-k
// swizzle atoms [NT rows][128 bytes]; wgmma step j of atom h (32 bytes of a
// row) holds in its pair slot P the pair 32 h + 8 (P % 4) + 2 j + P / 4,
// because the thread with fragment column pair P % 4 decodes word j of its
// 16-byte weight read (k 64 h + 16 (P % 4) ..) into the pairs (k, k + 1) for
// P < 4 and (k + 2, k + 3) for P >= 4. Inverted: pair pp is slot
// 8 j + P with chunk 2 j + P / 4 = pp % 8 and word P % 4 = pp / 8 % 4.
template <int NT>
__device__ __forceinline__ uint32_t w8a16_pair_offset(int n, int pp) {
  return uint32_t((pp >> 5) * NT * 128 + n * 128 + (((pp & 7) ^ (n & 7)) << 4) + (((pp >> 3) & 3) << 2));
}

// kW8A16: this thread's two weight rows of the stage (a_rows: row
// 16 w + g of the warpgroup's 64, the other 8 rows on) decoded into the A
// fragments of the block's eight k16 steps, then the chain of eight wgmmas
// over the activation atoms (db0: atom 0 at the warpgroup's tokens).
template <int WN, int NT, int C>
__device__ __forceinline__ void w8a16_block(float (&part)[C][WN / 2], uint32_t a_rows, uint64_t db0, int g, int q) {
  uint32_t raw[2][2][4];  // [atom h][row g, g + 8][word j]: k 64 h + 16 q + 4 j ..
#pragma unroll
  for (int h = 0; h < 2; ++h)
#pragma unroll
    for (int v = 0; v < 2; ++v)
      asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n"
                   : "=r"(raw[h][v][0]), "=r"(raw[h][v][1]), "=r"(raw[h][v][2]), "=r"(raw[h][v][3])
                   : "r"(a_rows + uint32_t(v * 8 * 128 + (((4 * h + q) ^ g) << 4))));
  uint32_t af[8][4];  // step 4 h + j: pairs (k, k + 1) then (k + 2, k + 3) of word j, rows g and g + 8
#pragma unroll
  for (int st = 0; st < 8; ++st) {
    // bytes (b0, b2, b1, b3): the even decoder then takes (b0, b1), the odd one (b2, b3)
    const uint32_t t0 = __byte_perm(raw[st >> 2][0][st & 3], 0, 0x3120);
    const uint32_t t1 = __byte_perm(raw[st >> 2][1][st & 3], 0, 0x3120);
    af[st][0] = e4m3_even_bf16(t0), af[st][1] = e4m3_even_bf16(t1);
    af[st][2] = e4m3_odd_bf16(t0), af[st][3] = e4m3_odd_bf16(t1);
  }
  wgmma_fence();  // the fragments are registers the wgmmas read
  // Step st into chain st % C; + 32 bytes a step, + NT rows of 128 bytes an
  // atom (descriptor units of 16).
#pragma unroll
  for (int st = 0; st < 8; ++st) {
    const uint64_t db = db0 + uint64_t((st >> 2) * NT * 8 + 2 * (st & 3));
    if (st < C) wgmma_bf16_rs<WN, 0>(part[st % C], af[st], db);
    else wgmma_bf16_rs<WN, 1>(part[st % C], af[st], db);
  }
}

template <int NT, GemvWeight W>
__global__ void __launch_bounds__(GemmTile<NT, W>::kThreads, GemmTile<NT, W>::kCtasPerSm)
    gemm_kernel(const __grid_constant__ GemvArgs a) {
  using Tile = GemmTile<NT, W>;
  constexpr int D = Tile::kStages, R = Tile::kCopyRows;
  extern __shared__ __align__(16) uint8_t smem_raw[];
  // 1024-byte aligned (swizzle atoms) as an offset from smem_raw, so every
  // access stays a shared-memory one.
  uint8_t* smem = smem_raw + ((1024 - (smem_u32(smem_raw) & 1023)) & 1023);
  const uint32_t ring = smem_u32(smem);
  float* sx = reinterpret_cast<float*>(smem + D * Tile::kStageBytes);
  float* sw = sx + D * Tile::kXScales;

  const int tid = threadIdx.x;
  const int splits = int(gridDim.x);
  const int kbc = int(a.k / splits / 128);  // k blocks of this CTA
  const int64_t row0 = int64_t(blockIdx.y) * kGemvCtaRows;
  const int64_t kcol0 = int64_t(blockIdx.x) * kbc * 128;      // within a group's k
  const int64_t xcol0 = (row0 / a.group_rows) * a.k + kcol0;  // the activation's columns of this group

  // Thread tid copies 16-byte chunk cc of rows cr + R j (weight: j < 128 / R;
  // FP8 tokens: j < NT / R, or rows cr < 16 for NT = 16), swizzled: chunk c
  // of row r lands at chunk c ^ (r % 8). bf16 tokens: pair pp = tid % 64 of
  // rows tid / 64 + 4 j (w8a16_pair_offset). Rows past n or m
  // read nothing and land as zeros; their sources stay at a valid row.
  // Everything but the k offset is fixed per thread.
  constexpr int kWeightCopies = kGemvCtaRows / R, kTokenCopies = NT >= R ? NT / R : 1;
  const int cr = tid >> 3, cc = tid & 7;
  const uint32_t dst = uint32_t(cr * 128 + ((cc ^ (cr & 7)) << 4));
  const int64_t wrow = row0 + cr < a.n ? row0 + cr : a.n - 1;
  const uint8_t* wsrc = static_cast<const uint8_t*>(a.w) + wrow * a.k + kcol0 + 16 * cc;
  const int64_t wstep = R * a.k;
  unsigned wvalid = 0, xvalid = 0;
#pragma unroll
  for (int j = 0; j < kWeightCopies; ++j) wvalid |= unsigned(row0 + cr + R * j < a.n) << j;
#pragma unroll
  for (int j = 0; j < kTokenCopies; ++j) xvalid |= unsigned(cr + R * j < a.m && cr + R * j < NT) << j;
  const uint8_t* xsrc = static_cast<const uint8_t*>(a.x) + int64_t(cr < a.m ? cr : 0) * a.ldx + xcol0 + 16 * cc;
  const int64_t xstep = R * a.ldx;
  const float* xscale = Tile::kBf16X ? nullptr : a.x_scales + (xcol0 / 128) * a.x_scale_ld + (tid < a.m ? tid : 0);
  const float* wscale = a.w_scales + int64_t(blockIdx.y) * a.w_scale_ld + kcol0 / 128;

  // kW8A16: this thread's pair pp of token rows n0 + 4 j (j < kPairCopies).
  // Row n0 + 4 j lands at x_even + 512 j for even j and at x_odd + 512 j for
  // odd j (w8a16_pair_offset: n % 8 is n0 or n0 + 4), and its source walks
  // from row n0 by 4 rows a copy, staying at the last row below m. Written
  // out so because the compiler recomputed each copy's row product and
  // swizzle every stage: about 14 instructions a 4-byte copy, over half of
  // the 128-token tile's instructions (docs/perf-notes.md, runs BG1-BG4).
  const int pp = tid & 63, n0 = tid >> 6;
  const uint32_t x_even = kATileBytes + w8a16_pair_offset<NT>(n0, pp);
  const uint32_t x_odd = kATileBytes + w8a16_pair_offset<NT>(n0 + 4, pp) - 512;
  const int x_rows = a.m > n0 ? (a.m - n0 + 3) / 4 : 0;  // copies j < x_rows read a row
  const uint16_t* x_row0 = static_cast<const uint16_t*>(a.x) + xcol0 + 2 * pp + (n0 < a.m ? n0 : 0) * a.ldx;
  const int64_t x_step = 4 * a.ldx;

  const uint64_t policy = l2_evict_first_policy();
  auto issue_weight = [&](int kb, uint32_t slot) {
    const uint8_t* src = wsrc + 128 * kb;
#pragma unroll
    for (int j = 0; j < kWeightCopies; ++j) {
      const bool ok = (wvalid >> j) & 1;
      cp_async_16(slot + dst + R * 128 * j, ok ? src + j * wstep : src, ok ? 16 : 0, policy);
    }
    if (tid == Tile::kThreads - 1) cp_async_4(smem_u32(sw + kb % D), wscale + kb, 4);
  };
  auto issue_tokens = [&](int kb, uint32_t slot) {
    if constexpr (Tile::kBf16X) {
      const uint16_t* src = x_row0 + 128 * kb;
      const uint32_t even = slot + x_even, odd = slot + x_odd;
      int rows = x_rows;
      // Opaque to the compiler, so that each copy's test is made here: hoisted
      // out of the loop, the 128-token tile's 32 tests spilled.
      asm volatile("" : "+r"(rows));
#pragma unroll
      for (int j = 0; j < Tile::kPairCopies; ++j) {
        cp_async_4((j & 1 ? odd : even) + 512 * j, src, j < rows ? 4 : 0);
        if (j + 1 < rows) src += x_step;
      }
    } else {
      const uint8_t* src = xsrc + 128 * kb;
#pragma unroll
      for (int j = 0; j < kTokenCopies; ++j) {
        const bool ok = (xvalid >> j) & 1;
        if (NT >= R || cr < NT) cp_async_16(slot + kATileBytes + dst + R * 128 * j, ok ? src + j * xstep : src, ok ? 16 : 0);
      }
      if (tid < NT) cp_async_4(smem_u32(sx + (kb % D) * NT + tid), xscale + kb * a.x_scale_ld, tid < a.m ? 4 : 0);
    }
  };

  // The weights of the first D - 1 stages fly while the previous kernel
  // ends; the activation follows the wait. Stage s is in commit group s
  // (group 0 also holds the early weights), then one group per iteration.
  for (int s = 0; s < D - 1; ++s)
    if (s < kbc) issue_weight(s, ring + uint32_t(s) * Tile::kStageBytes);
  pdl_start();
  for (int s = 0; s < D - 1; ++s) {
    if (s < kbc) issue_tokens(s, ring + uint32_t(s) * Tile::kStageBytes);
    cp_async_commit();
  }

  // Warpgroup wg: weight rows 64 (wg % 2) .., tokens tok0 = kWgTokens (wg / 2) ..
  constexpr int WN = Tile::kWgTokens;
  const int wg = tid >> 7, q = tid & 3, tok0 = WN * (wg >> 1);
  constexpr int C = Tile::kChains;
  float acc[Tile::kAcc], part[C][Tile::kAcc];
#pragma unroll
  for (int i = 0; i < Tile::kAcc; ++i) acc[i] = 0.0f;
  int slot_kb = 0, slot_next = D - 1;  // slots of stages kb and kb + D - 1
  // kW8A16: this thread's weight destination in slot slot_next, advanced with
  // it. Kept per thread on purpose: with the slot's address a uniform value
  // beside the thread's offset, ptxas (CUDA 13.0) issued the weight copies as
  // LDGSTS [R+UR] with the L2 policy, and they faulted as illegal
  // instructions (docs/perf-notes.md, run BG3).
  uint32_t w_next = ring + uint32_t(D - 1) * Tile::kStageBytes + dst;
  for (int kb = 0; kb < kbc; ++kb) {
    cp_async_wait_group<D - 2>();  // this thread's copies of stage kb have landed
    fence_proxy_async();
    __syncthreads();  // everyone's, and every warpgroup is done with stage kb - 1
    const uint32_t slot = ring + uint32_t(slot_kb) * Tile::kStageBytes;
    const uint32_t b_tile = slot + kATileBytes + uint32_t(tok0) * 128;
    if constexpr (Tile::kBf16X) {
      const int lane = tid & 31;
      const uint32_t a_rows = slot + uint32_t(64 * (wg & 1) + 16 * ((tid >> 5) & 3) + (lane >> 2)) * 128;
      w8a16_block<WN, NT, C>(part, a_rows, sw128_desc(b_tile, 16, 1024), lane >> 2, q);
    } else {
      const uint64_t da = sw128_desc(slot + uint32_t(wg & 1) * 64 * 128, 16, 1024);
      const uint64_t db = sw128_desc(b_tile, 16, 1024);
      wgmma_fence();
      // + 32 bytes of k per step (descriptor units of 16); with C = 4 each step is its own chain
      wgmma_e4m3_ss<WN, 0>(part[0], da, db);
      if constexpr (C == 4) {
        wgmma_e4m3_ss<WN, 0>(part[1], da + 2, db + 2);
        wgmma_e4m3_ss<WN, 0>(part[2], da + 4, db + 4);
        wgmma_e4m3_ss<WN, 0>(part[3], da + 6, db + 6);
      } else {
        wgmma_e4m3_ss<WN, 1>(part[0], da + 2, db + 2);
        wgmma_e4m3_ss<WN, 1>(part[0], da + 4, db + 4);
        wgmma_e4m3_ss<WN, 1>(part[0], da + 6, db + 6);
      }
    }
    wgmma_commit();
    if (kb + D - 1 < kbc) {  // into stage kb - 1's slot while the MMAs run
      const uint32_t next = Tile::kBf16X ? w_next - dst : ring + uint32_t(slot_next) * Tile::kStageBytes;
      issue_weight(kb + D - 1, next);
      issue_tokens(kb + D - 1, next);
    }
    cp_async_commit();
    wgmma_wait<0>();
#pragma unroll
    for (int j = 0; j < C; ++j) fence_regs(part[j]);
    const float swk = sw[slot_kb];
    const float* sxk = sx + slot_kb * Tile::kXScales + tok0;
#pragma unroll
    for (int i = 0; i < WN / 8; ++i) {
      float s0 = swk, s1 = swk;  // bf16 activations carry no scale
      if constexpr (!Tile::kBf16X) {
        const float2 s = *reinterpret_cast<const float2*>(sxk + 8 * i + 2 * q);
        s0 = s.x * swk, s1 = s.y * swk;
      }
#pragma unroll
      for (int j = 0; j < C; ++j) {  // in k order
        acc[4 * i + 0] = fmaf(part[j][4 * i + 0], s0, acc[4 * i + 0]);
        acc[4 * i + 1] = fmaf(part[j][4 * i + 1], s1, acc[4 * i + 1]);
        acc[4 * i + 2] = fmaf(part[j][4 * i + 2], s0, acc[4 * i + 2]);
        acc[4 * i + 3] = fmaf(part[j][4 * i + 3], s1, acc[4 * i + 3]);
      }
    }
    slot_kb = slot_kb + 1 == D ? 0 : slot_kb + 1;
    w_next = slot_next + 1 == D ? w_next - uint32_t(D - 1) * Tile::kStageBytes : w_next + Tile::kStageBytes;
    slot_next = slot_next + 1 == D ? 0 : slot_next + 1;
  }

  // This CTA's tile [NT tokens][128 weight rows] over the ring (row stride
  // kCtStride: the lanes of a warp hit 32 different banks).
  cp_async_wait_group<0>();
  __syncthreads();
  float* ct = reinterpret_cast<float*>(smem);
  const int row = 64 * (wg & 1) + 16 * ((tid >> 5) & 3) + ((tid & 31) >> 2);
#pragma unroll
  for (int i = 0; i < WN / 8; ++i)
#pragma unroll
    for (int v = 0; v < 2; ++v)
#pragma unroll
      for (int c = 0; c < 2; ++c)
        ct[(tok0 + 8 * i + 2 * q + c) * kCtStride + row + 8 * v] = acc[4 * i + 2 * v + c];
  // Every tile of the cluster is complete (its CTAs' writes visible to all);
  // then this CTA sums token rows blockIdx.x, + splits, ... over them.
  const bool in_cluster = splits > 1 && !a.global_sum;
  if (in_cluster) cluster_sync();
  else __syncthreads();
  const int cols = int(a.n - row0 < kGemvCtaRows ? a.n - row0 : kGemvCtaRows);
  if constexpr (Tile::kThreads == kGemvThreads) {
    if (a.global_sum) {  // the last CTA of the row block to arrive sums the splits and writes every row
      if (splits > 1 && !reduce_splits(a, ct, int(blockIdx.x), int(blockIdx.y), int(gridDim.y))) return;
      for (int t = tid >> 5; t < a.m; t += Tile::kThreads / 32) write_row<Tile::kBf16X>(a, ring, t, tid & 31, 1, cols);
      if constexpr (Tile::kTails) run_tail(a, int(blockIdx.y), int(gridDim.y), 1, 0, 1, smem);
      return;
    }
  }
  for (int t = int(blockIdx.x) + splits * (tid >> 5); t < a.m; t += splits * (Tile::kThreads / 32))
    write_row<Tile::kBf16X>(a, ring, t, tid & 31, splits, cols);
  if (in_cluster) cluster_sync();  // no CTA leaves while another reads its tile
  if constexpr (Tile::kTails) run_tail(a, int(blockIdx.y), int(gridDim.y), splits, int(blockIdx.x), splits, smem);
}

template <int NT, GemvWeight W>
void gemm_launch_nt(const GemvArgs& a, cudaStream_t stream) {
  using Tile = GemmTile<NT, W>;
  // The kernel sums splits through the workspace (global_sum) only in tiles of
  // kGemvThreads threads: every tile that rows up to kGemmGlobalSumRows pick.
  static_assert(NT > kGemmGlobalSumRows || Tile::kThreads == kGemvThreads, "global_sum tiles");
  const dim3 grid(unsigned(a.splits), unsigned((a.n + kGemvCtaRows - 1) / kGemvCtaRows));
  pdl_launch_clustered(gemm_kernel<NT, W>, grid, Tile::kThreads, Tile::kSmemBytes, stream, a.global_sum ? 1 : a.splits, a);
}

// Clusters of 1, 2, 4 and 8 CTAs each FP8 tile size's kernel can hold
// resident at once ([tile 8..128][log2 splits]; gemm_configure; the FP8 x
// bf16 tiles choose their splits without them). A cluster's CTAs must share
// a GPC, so this can be fewer than the CTA slots divided by the cluster
// size: wo_b's 32 clusters of 8 took 14.1 us at one row where 4 splits took
// 11.4 (docs/perf-notes.md, run T1).
int g_max_clusters[5][4] = {};

// The tile of m tokens: 8, 16, 32, 64, 128 tokens as 0 .. 4.
int tile_index(int m) { return m <= 8 ? 0 : m <= 16 ? 1 : m <= 32 ? 2 : m <= 64 ? 3 : 4; }

template <int NT, GemvWeight W>
cudaError_t gemm_configure_nt() {
  using Tile = GemmTile<NT, W>;
  cudaError_t e =
      cudaFuncSetAttribute(gemm_kernel<NT, W>, cudaFuncAttributeMaxDynamicSharedMemorySize, int(Tile::kSmemBytes));
  if constexpr (W == GemvWeight::kFp8) {
    for (int i = 0; i < 4 && e == cudaSuccess; ++i)
      e = max_active_clusters(gemm_kernel<NT, W>, dim3(1u << i), Tile::kThreads, Tile::kSmemBytes,
                              &g_max_clusters[tile_index(NT)][i]);
  }
  return e;
}

template <GemvWeight W>
void gemm_launch_kind(const GemvArgs& a, cudaStream_t stream) {
  switch (gemm_tile_rows(a.m)) {
    case 8: gemm_launch_nt<8, W>(a, stream); break;
    case 16: gemm_launch_nt<16, W>(a, stream); break;
    case 32: gemm_launch_nt<32, W>(a, stream); break;
    case 64: gemm_launch_nt<64, W>(a, stream); break;
    default: gemm_launch_nt<128, W>(a, stream);
  }
}

}  // namespace

int gemm_tile_rows(int m) { return 8 << tile_index(m); }

// The most splits (1, 2, 4 or 8: one cluster) dividing the k blocks that
// keep the grid in one wave (every row block's cluster resident at once)
// and leave each CTA at least 4 k blocks to pipeline. FP8 x bf16 tiles
// instead take as many CTAs as their SMs hold (two an SM up to 32 tokens,
// one from 64), resident clusters or not: their decode and dependent wgmmas
// make one CTA's k blocks slow, and a second CTA on the SM hides them
// (docs/perf-notes.md, runs Y1-Y2).
//
// FP8 decode rows (up to kGemmGlobalSumRows) take the split that fills two
// CTAs an SM where resident clusters allow fewer, summed through the
// workspace instead of a cluster: wo_b's 32 row blocks ran 128 CTAs in
// clusters of 4 (clusters of 8 do not all fit), a lone CTA on its SM, at
// 1.45x its bytes; 256 CTAs without clusters took 2-2.5 us less in the
// batch-1 layer (docs/perf-notes.md, run AA1). Larger tiles keep the
// cluster: their partials are more bytes to write and read back.
GemmSplit gemm_choose_splits(GemvWeight kind, int64_t n, int64_t k, int m, int forced) {
  const int64_t kb = k / 128, nrb = (n + kGemvCtaRows - 1) / kGemvCtaRows;
  if (forced > 0 && forced <= kGemmMaxSplits && kb % forced == 0) return {forced, false};
  gemv_prepare();  // fills g_max_clusters
  const int* clusters = g_max_clusters[tile_index(m)];
  const bool fp8 = kind == GemvWeight::kFp8;
  // The FP8 x bf16 tile's CTAs an SM ([tile 8..128]); FP8 tiles count two.
  constexpr int kW8A16CtasPerSm[5] = {
      GemmTile<8, GemvWeight::kW8A16>::kCtasPerSm, GemmTile<16, GemvWeight::kW8A16>::kCtasPerSm,
      GemmTile<32, GemvWeight::kW8A16>::kCtasPerSm, GemmTile<64, GemvWeight::kW8A16>::kCtasPerSm,
      GemmTile<128, GemvWeight::kW8A16>::kCtasPerSm};
  const int per_sm = fp8 ? 2 : kW8A16CtasPerSm[tile_index(m)];
  int s = 1, g = 1;  // in a cluster; filling two CTAs an SM
  for (int i = 1, d = 2; d <= kGemmMaxSplits; ++i, d *= 2) {
    if (kb % d != 0 || kb / d < 4) continue;
    const bool fills_two = nrb * d <= per_sm * device_sm_count();
    if (fills_two) g = d;
    if (fp8 ? nrb <= clusters[i] : fills_two) s = d;
  }
  if (fp8 && m <= kGemmGlobalSumRows && g > s) return {g, true};
  return {s, false};
}

int gemm_resident_clusters(int m, int splits) {
  DSV4_REQUIRE(m >= 1 && m <= kGemmMaxRows && (splits == 1 || splits == 2 || splits == 4 || splits == 8),
               "linear (cuda): resident clusters are known for 1-128 rows and 1, 2, 4 or 8 splits");
  gemv_prepare();  // fills g_max_clusters
  return g_max_clusters[tile_index(m)][cluster_size_index(splits)];
}

cudaError_t gemm_configure() {
  constexpr GemvWeight F = GemvWeight::kFp8, H = GemvWeight::kW8A16;
  cudaError_t e = gemm_configure_nt<8, F>();
  if (e == cudaSuccess) e = gemm_configure_nt<16, F>();
  if (e == cudaSuccess) e = gemm_configure_nt<32, F>();
  if (e == cudaSuccess) e = gemm_configure_nt<64, F>();
  if (e == cudaSuccess) e = gemm_configure_nt<128, F>();
  if (e == cudaSuccess) e = gemm_configure_nt<8, H>();
  if (e == cudaSuccess) e = gemm_configure_nt<16, H>();
  if (e == cudaSuccess) e = gemm_configure_nt<32, H>();
  if (e == cudaSuccess) e = gemm_configure_nt<64, H>();
  if (e == cudaSuccess) e = gemm_configure_nt<128, H>();
  return e;
}

void gemm_launch(const GemvArgs& a, CUstream_st* stream) {
  gemv_prepare();  // configures this kernel too
  const bool fp8 = a.kind == GemvWeight::kFp8;
  DSV4_REQUIRE((fp8 || a.kind == GemvWeight::kW8A16) && !a.y_f32 && a.m >= 1 && a.m <= kGemmMaxRows &&
                   a.splits >= 1 && a.splits <= kGemmMaxSplits && (a.k / 128) % a.splits == 0,
               "linear (cuda): the wgmma GEMM takes FP8 and FP8 x bf16 products of 1-128 rows to bf16, split 1-8 "
               "ways");
  DSV4_REQUIRE(!a.quantize || (!fp8 && a.n % kGemvCtaRows == 0),
               "linear (cuda): the wgmma GEMM quantizes only FP8 x bf16 outputs of whole 128-column blocks");
  DSV4_REQUIRE(a.q_head.counters == nullptr || (fp8 && a.m <= kGemvQHeadRows && a.n % 512 == 0),
               "linear (cuda): the FP8 GEMM's q-head tail takes whole heads of up to 8 rows");
  DSV4_REQUIRE(!(a.q_head.counters && a.residual.counter), "linear (cuda): one tail per launch");
  DSV4_REQUIRE(a.residual.counter == nullptr || (fp8 && a.m <= kGemvTailRows && gemv_residual_tail_fits(a.n)),
               "linear (cuda): the FP8 GEMM's residual tail takes whole 128-column blocks of up to 8 rows");
  DSV4_REQUIRE(!a.global_sum || (fp8 && a.m <= kGemmGlobalSumRows && a.partials && a.counters),
               "linear (cuda): the GEMM sums splits through the workspace only for FP8 rows of up to 8, with partials "
               "and counters");
  if (fp8) gemm_launch_kind<GemvWeight::kFp8>(a, stream);
  else gemm_launch_kind<GemvWeight::kW8A16>(a, stream);
  check_cuda(cudaGetLastError(), "wgmma GEMM launch");
}

}  // namespace dsv4::cuda::detail
