#pragma once
// The linears' small-M kernel (M <= 64 rows of activation per launch).
//
// A CTA of 8 warps owns 128 weight rows (one row block of the 128x128 weight
// scales) and a slice of k (split-K over blockIdx.y). Each warp streams its
// 16 rows with 16-byte loads (3 stages in flight) and multiplies them on the
// tensor cores (mma.m16n8k16) with the activation slice, which the CTA first
// decodes into shared memory. The weight is the MMA's A operand (16 rows), the
// activation rows are B's columns (8 per tile, MT tiles).
//
// Exact operands. FP8 x FP8: both sides are decoded to f16 by bit moves that
// give the e4m3 value times 2^-8 exactly (subnormals included); the products
// are exact in the fp32 accumulator and each 128-wide block's sum is scaled by
// sx * sw * 2^16 (powers of two) into the running sum. FP8 weight x bf16: the
// weight becomes bf16 (bits times 2^-120, then one exact bf16 multiply by
// 2^120), so the MMA multiplies the dequantized bf16 weight. bf16 x bf16: as is.
//
// K order. Inside a 16-byte load each thread holds 4 consecutive k per step
// (physical k 4q..4q+3); the MMA only needs A and B to agree on which k sits
// where, so the decoders pair (4q, 4q+2) and (4q+1, 4q+3) and the activation
// is stored in shared memory in the same pairing: word 2q and 2q+1 of a row.
//
// Split-K: with 2, 4 or 8 splits whose clusters all fit at once, a row
// block's splits are one cluster and each CTA sums its share of the token
// rows over the cluster's tiles (DSMEM). Otherwise every CTA writes its
// partial tile to the workspace, and the last CTA of a row block (arrival
// counter) sums the splits, writes the outputs and resets the counter. Both
// add the splits in the fixed order 0..splits-1 (the same bits).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "attn/cuda/act_quant.cuh"
#include "attn/cuda/linear.h"
#include "attn/cuda/linear_internal.h"
#include "attn/cuda/pdl.cuh"
#include "attn/cuda/ptx.cuh"
#include "attn/cuda/q_head_norm_rope.cuh"
#include "attn/cuda/residual_rows.cuh"
#include "attn/cuda/warp.cuh"

namespace dsv4::cuda::detail {

inline constexpr int kGemvWarps = 8;
inline constexpr int kGemvThreads = 32 * kGemvWarps;
inline constexpr int kCtStride = kGemvCtaRows + 4;  // floats per row of the output tile in shared memory
inline constexpr int kGemvDepth = 3;                // stages of weight loads in flight per thread

// ---- exact decoders --------------------------------------------------------

// e4m3 bytes (b0 lowest) of w: (b0, b2) and (b1, b3) as f16x2 holding the
// values times 2^-8. The e4m3 exponent and mantissa bits are the f16's low
// exponent and high mantissa bits; only the sign moves.
__device__ __forceinline__ uint32_t e4m3_even_f16(uint32_t w) {
  const uint32_t v = (w & 0x00ff00ffu) << 7;  // sign lands on bit 14 (30): carry it into bit 15 (31)
  return v + (v & 0x40004000u);
}
__device__ __forceinline__ uint32_t e4m3_odd_f16(uint32_t w) { return ((w >> 1) & 0x3f803f80u) | (w & 0x80008000u); }

// The same pairs as bf16x2 holding the values exactly: the bits give the
// value times 2^-120 (e4m3 subnormals become bf16 subnormals), and one exact
// bf16 multiply by 2^120 restores it.
__device__ __forceinline__ uint32_t bf16x2_times_2p120(uint32_t v) { return bf16x2_mul(v, 0x7b807b80u); }
__device__ __forceinline__ uint32_t e4m3_even_bf16(uint32_t w) {
  return bf16x2_times_2p120(((w & 0x007f007fu) << 4) | ((w & 0x00800080u) << 8));
}
__device__ __forceinline__ uint32_t e4m3_odd_bf16(uint32_t w) {
  return bf16x2_times_2p120(((w >> 4) & 0x07f007f0u) | (w & 0x80008000u));
}

// ---- MMA and loads ---------------------------------------------------------

template <bool kBf16>
__device__ __forceinline__ void mma16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  if constexpr (kBf16) {
    mma_bf16_16816(c, a, b0, b1);  // ptx.cuh
  } else {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

// Weights are read once per call: keep them out of L1.
__device__ __forceinline__ uint4 load_weight16(const uint8_t* p) {
  uint4 v;
  asm("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
      : "l"(p));
  return v;
}

// ---- per-kind constants ----------------------------------------------------

template <GemvWeight W>
struct GemvKind;
template <>
struct GemvKind<GemvWeight::kFp8> {
  static constexpr int kElemBytes = 1;
  static constexpr int kChunkK = 64;   // k of one 16-byte load per thread, 4 threads per row
  static constexpr bool kBf16Mma = false;
  static constexpr bool kScaled = true;
  static constexpr int kPadWords = 2;  // 8-byte reads per thread and step: row stride 2 mod 32 words
};
template <>
struct GemvKind<GemvWeight::kW8A16> {
  static constexpr int kElemBytes = 1;
  static constexpr int kChunkK = 64;
  static constexpr bool kBf16Mma = true;
  static constexpr bool kScaled = true;
  static constexpr int kPadWords = 2;
};
template <>
struct GemvKind<GemvWeight::kBf16> {
  static constexpr int kElemBytes = 2;
  static constexpr int kChunkK = 32;
  static constexpr bool kBf16Mma = true;
  static constexpr bool kScaled = false;
  static constexpr int kPadWords = 16;  // one 16-byte read per thread and chunk: stride 16 mod 32 words
};

// A stage: two rows x two chunks of 16-byte loads per thread.
template <GemvWeight W>
inline constexpr int kStageK = 2 * GemvKind<W>::kChunkK;

// Shared memory: the decoded activation slice [8 MT][kc / 2 + pad] words
// (reused for the fp32 output tile), then its scales [8 MT][kc / 128].
template <GemvWeight W>
constexpr size_t gemv_smem_bytes(int tile_rows, int64_t kc) {
  const size_t xs = size_t(tile_rows) * size_t(kc / 2 + GemvKind<W>::kPadWords);
  const size_t ct = size_t(tile_rows) * size_t(kCtStride);
  const size_t sc = W == GemvWeight::kFp8 ? size_t(tile_rows) * size_t(kc / 128) : 0;
  return 4 * ((xs > ct ? xs : ct) + sc);
}

// ---- the kernel --------------------------------------------------------------

// Decodes this CTA's activation slice (columns xcol0 .. xcol0 + kc of rows
// < m; zeros for the tile's other rows) into shared memory.
template <GemvWeight W, int T>
__device__ __forceinline__ void stage_activation(const GemvArgs& a, uint32_t* xs, int xstride, float* xsc, int kc,
                                                 int64_t xcol0) {
  if constexpr (W == GemvWeight::kFp8) {
    const int pieces = kc / 16;  // 16 e4m3 -> 8 words
    for (int i = threadIdx.x; i < T * pieces; i += kGemvThreads) {
      const int r = i / pieces, p = i - r * pieces;
      uint4 v = make_uint4(0, 0, 0, 0);
      if (r < a.m)
        v = *reinterpret_cast<const uint4*>(static_cast<const uint8_t*>(a.x) + int64_t(r) * a.ldx + xcol0 + 16 * p);
      uint2* dst = reinterpret_cast<uint2*>(xs + r * xstride + 8 * p);  // rows are only 8-byte aligned
      dst[0] = make_uint2(e4m3_even_f16(v.x), e4m3_odd_f16(v.x));
      dst[1] = make_uint2(e4m3_even_f16(v.y), e4m3_odd_f16(v.y));
      dst[2] = make_uint2(e4m3_even_f16(v.z), e4m3_odd_f16(v.z));
      dst[3] = make_uint2(e4m3_even_f16(v.w), e4m3_odd_f16(v.w));
    }
    const int kbc = kc / 128;
    const int64_t kb0 = xcol0 / 128;
    for (int i = threadIdx.x; i < T * kbc; i += kGemvThreads) {
      const int r = i / kbc, kb = i - r * kbc;
      xsc[i] = r < a.m ? a.x_scales[(kb0 + kb) * a.x_scale_ld + r] : 0.0f;
    }
  } else {
    const int pieces = kc / 8;  // 8 bf16 -> 4 words
    for (int i = threadIdx.x; i < T * pieces; i += kGemvThreads) {
      const int r = i / pieces, p = i - r * pieces;
      uint4 v = make_uint4(0, 0, 0, 0);
      if (r < a.m) {
        v = *reinterpret_cast<const uint4*>(static_cast<const uint16_t*>(a.x) + int64_t(r) * a.ldx + xcol0 + 8 * p);
        if constexpr (W == GemvWeight::kW8A16) {  // pair (4q, 4q+2) and (4q+1, 4q+3) like the weight decoder
          v = make_uint4(__byte_perm(v.x, v.y, 0x5410), __byte_perm(v.x, v.y, 0x7632), __byte_perm(v.z, v.w, 0x5410),
                         __byte_perm(v.z, v.w, 0x7632));
        }
      }
      if constexpr (GemvKind<W>::kPadWords % 4 == 0) {
        *reinterpret_cast<uint4*>(xs + r * xstride + 4 * p) = v;
      } else {  // rows only 8-byte aligned (kW8A16 reads them 8 bytes at a time)
        uint2* dst = reinterpret_cast<uint2*>(xs + r * xstride + 4 * p);
        dst[0] = make_uint2(v.x, v.y);
        dst[1] = make_uint2(v.z, v.w);
      }
    }
  }
}

// Whether this CTA is the last of `count` to arrive at *counter, after the
// writes of all its threads; the last one then sees every other CTA's. One
// thread's acq_rel arrival between two CTA barriers carries the whole CTA's
// writes (release cumulativity of the PTX memory model, CUTLASS's semaphore
// pattern), where a fence in every thread before and after a plain atomic
// did the same with more waiting.
__device__ __forceinline__ bool last_to_arrive(unsigned* counter, unsigned count) {
  __shared__ int is_last;
  __syncthreads();
  if (threadIdx.x == 0) {
    unsigned before;
    asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], 1;\n" : "=r"(before) : "l"(counter) : "memory");
    is_last = before == count - 1;
  }
  __syncthreads();
  return is_last;
}

// Sums the splits of this row block in fixed order; false for every CTA but
// the last to arrive. ct holds this CTA's partial tile on entry and the total
// on return (true). Also the GEMM's global_sum (split `split` of row block rb
// of nrb). Four columns a thread: a tile of up to 8 rows is one pass.
__device__ __forceinline__ bool reduce_splits(const GemvArgs& a, float* ct, int split, int rb, int nrb) {
  const int tile4 = a.m * kGemvCtaRows / 4;  // float4 of the tile
  float4* mine = reinterpret_cast<float4*>(a.partials) + (size_t(split) * nrb + rb) * size_t(tile4);
  auto at = [&](int i) { return reinterpret_cast<float4*>(ct + (i >> 5) * kCtStride + 4 * (i & 31)); };
  for (int i = threadIdx.x; i < tile4; i += blockDim.x) mine[i] = *at(i);
  if (!last_to_arrive(&a.counters[rb], unsigned(a.splits))) return false;
  // kBatch independent loads before the first add (a loop of unknown trip
  // count issues them a few at a time: many round trips to L2 for 32
  // splits); the adds stay in split order, so the sum is the same bits.
  constexpr int kBatch = 8;
  const size_t split_stride = size_t(nrb) * size_t(tile4);
  for (int i = threadIdx.x; i < tile4; i += blockDim.x) {
    const float4* src = reinterpret_cast<const float4*>(a.partials) + size_t(rb) * size_t(tile4) + i;
    float4 s = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    for (int sp0 = 0; sp0 < a.splits; sp0 += kBatch) {
      float4 v[kBatch];
#pragma unroll
      for (int b = 0; b < kBatch; ++b)
        v[b] = sp0 + b < a.splits ? __ldcg(src + size_t(sp0 + b) * split_stride) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll
      for (int b = 0; b < kBatch; ++b)
        if (sp0 + b < a.splits) s.x += v[b].x, s.y += v[b].y, s.z += v[b].z, s.w += v[b].w;
    }
    *at(i) = s;
  }
  if (threadIdx.x == 0) a.counters[rb] = 0;  // ready for the next call
  __syncthreads();
  return true;
}

// The cluster's sum of the splits (a.cluster_sum: the row block's splits
// are one cluster along y, rank = split): this CTA sums token rows first,
// first + splits, ... over every split's tile (DSMEM, split order from 0,
// the bits of reduce_splits) into its own tile; every row has one owner, so
// no tile row is both read remotely and written. Returns once no CTA reads
// another's tile any more.
__device__ __forceinline__ void sum_cluster_rows(const GemvArgs& a, float* ct, int first) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  cluster_sync();  // every split's tile is complete and visible
  for (int r = first + a.splits * warp; r < a.m; r += a.splits * kGemvWarps) {
    float* row = ct + r * kCtStride + 4 * lane;
    *reinterpret_cast<float4*>(row) = cluster_sum4(smem_u32(row), a.splits);
  }
  cluster_sync();  // no CTA leaves (or reuses its tile) while another reads it
}

// Writes y (and q) from the finished tile ct: token rows first, first + step, ...
__device__ __forceinline__ void write_outputs(const GemvArgs& a, const float* ct, int first, int step) {
  const int64_t col0 = int64_t(blockIdx.x) * kGemvCtaRows;
  const int cols = int(a.n - col0 < kGemvCtaRows ? a.n - col0 : kGemvCtaRows);
  const int rows = first < a.m ? (a.m - first + step - 1) / step : 0;
  for (int i = threadIdx.x; i < rows * kGemvCtaRows; i += kGemvThreads) {
    const int r = first + step * (i >> 7), c = i & 127;
    if (c >= cols) continue;
    const float v = ct[r * kCtStride + c];
    if (a.y_f32)
      static_cast<float*>(a.y)[r * a.ldy + col0 + c] = v;
    else
      static_cast<uint16_t*>(a.y)[r * a.ldy + col0 + c] = bf16_store(v);
  }
  if (a.quantize) {  // the host guarantees whole 128-column blocks
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    for (int r = first + step * warp; r < a.m; r += step * kGemvWarps) {
      const float4 f = *reinterpret_cast<const float4*>(ct + r * kCtStride + 4 * lane);
      const float v[4] = {bf16_round(f.x), bf16_round(f.y), bf16_round(f.z), bf16_round(f.w)};
      store_act_block(a.q, r, int(blockIdx.x), v);
    }
  }
}

// The q-head tail (GemvQHeadTail): the last of a head's four row blocks to
// arrive (the arrival-counter pattern of reduce_splits) norms and rotates
// the head of every row, in the shared memory the tile no longer needs.
// row_block is this CTA's 128-row block of y; `arrivals` CTAs write a head
// (its 4 row blocks, times the CTAs that share a row block's outputs in the
// wgmma GEMM's split-K). Also the GEMM's tail (linear_gemm.cu).
static_assert(kGemvQHeadRows == kQHeadRows && kGemvThreads == kQHeadThreads && 512 % kGemvCtaRows == 0);
__device__ __forceinline__ void q_head_tail(const GemvArgs& a, int row_block, unsigned arrivals, void* smem) {
  constexpr int kBlocksPerHead = 512 / kGemvCtaRows;
  const int head = row_block / kBlocksPerHead;
  if (!last_to_arrive(a.q_head.counters + head, arrivals)) return;  // after this CTA's outputs
  uint16_t* y = static_cast<uint16_t*>(a.y) + int64_t(head) * 512;
  q_head_rows(
      a.m, [&](int r) { return y + int64_t(r) * a.ldy; },
      [&](int r, int i) { return rope_cos_sin(int64_t(__ldg(a.q_head.positions + r)), a.q_head.rope.inv_freq[i]); },
      a.q_head.eps, *reinterpret_cast<QHeadSmem*>(smem));
  if (threadIdx.x == 0) a.q_head.counters[head] = 0;  // ready for the next call
}

// A barrier among `total` CTAs of the launch, each arriving once (they must
// all be resident, or become so while the others wait): the last to arrive
// (last_to_arrive's acq_rel arrival) resets the counter and moves the
// generation on from `gen` (read before the arrival) with a release store;
// the others wait for that with acquire loads. So every CTA's writes before
// its arrival are visible to every CTA after it.
__device__ __forceinline__ void writers_barrier(unsigned* counter, unsigned* generation, unsigned gen,
                                                unsigned total) {
  if (last_to_arrive(counter, total)) {
    if (threadIdx.x == 0) {  // nobody reads the counter any more: ready for the next call
      *counter = 0;
      asm volatile("st.release.gpu.global.u32 [%0], %1;\n" ::"l"(generation), "r"(gen + 1) : "memory");
    }
  } else if (threadIdx.x == 0) {
    unsigned now = gen;
    while (now == gen) asm volatile("ld.acquire.gpu.global.u32 %0, [%1];\n" : "=r"(now) : "l"(generation) : "memory");
  }
  __syncthreads();
}

// The residual tail (GemvResidualTail) in a CTA that wrote token rows first,
// first + step, ... of row block rb (of nrb; `writers` CTAs wrote outputs):
// warp w takes row first + step w (one at most: up to kGemvTailRows rows),
// adds y to h and leaves the block's sum of squares, then after the barrier
// scales its values, still in registers, by the norm from the row's sums in
// block order. smem: nrb doubles a row.
static_assert(kGemvTailRows <= kGemvWarps, "the residual tail: one row a warp");
__device__ __forceinline__ void residual_tail(const GemvArgs& a, int rb, int nrb, int first, int step,
                                              unsigned writers, void* smem) {
  const GemvResidualTail& rt = a.residual;
  const ResidualNormParams& p = rt.norm;
  const int warp = int(threadIdx.x >> 5), lane = int(threadIdx.x & 31);
  const int t = first + step * warp;
  const bool mine = t < p.num_tokens, real = t < residual_real_rows(p);
  unsigned gen = 0;  // relaxed: the arrival's release orders it first; it flies with the loads below
  if (threadIdx.x == 0) asm volatile("ld.relaxed.gpu.global.u32 %0, [%1];\n" : "=r"(gen) : "l"(rt.generation) : "memory");
  __syncthreads();  // the CTA's writes of y are visible to all its threads
  float4 h = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  if (real) {
    h = residual_block_in(p, t, rb);
    const double s = residual_block_squares(h);
    if (lane == 0) __stcg(rt.sums + t * nrb + rb, s);
  }
  writers_barrier(rt.counter, rt.generation, gen, writers);
  double* red = static_cast<double*>(smem) + warp * nrb;
  if (real)
    for (int b = lane; b < nrb; b += 32) red[b] = __ldcg(rt.sums + t * nrb + b);
  __syncwarp();
  if (mine) residual_block_out(p, t, rb, h, real ? residual_row_inv(p, red) : 0.0f, real);
}

// The tail the launch asks for (at most one), after this CTA's outputs:
// token rows first, first + step, ... of row block rb (of nrb), each row
// block written by `writers` CTAs (1, or its cluster's).
__device__ __forceinline__ void run_tail(const GemvArgs& a, int rb, int nrb, int writers, int first, int step,
                                         void* smem) {
  if (a.q_head.counters != nullptr) q_head_tail(a, rb, unsigned(512 / kGemvCtaRows * writers), smem);
  if (a.residual.counter != nullptr) residual_tail(a, rb, nrb, first, step, unsigned(nrb * writers), smem);
}
// Shared memory of the residual tail: the row sums of up to kGemvTailRows rows.
inline constexpr size_t kResidualTailSmem = size_t(kGemvTailRows) * (kResidualMaxDim / kGemvCtaRows) * sizeof(double);

// CTAs per SM the kernel is compiled for: 2 (at MT <= 4 it takes the 128
// registers that allows, ptxas -v), or for decode rows on a grid of more
// than two waves at 2, a dense variant at 3 (80 registers) that runs it in
// one. Measured (docs/perf-notes.md, run D2):
// the dense variant is 1.3x faster on such grids (wq_a+wkv: 384 CTAs) and
// 1.2x slower on one-wave grids (wq_b, wo_a, wo_b: 256 CTAs).
template <int MT>
inline constexpr int kGemvCtasPerSm = MT <= 4 ? 2 : 1;
inline constexpr int kGemvDenseCtasPerSm = 3;

// kStamps: the diagnostics instantiation (set_small_m_stamps): thread 0 of
// each CTA writes %globaltimer at the SmallMStamp points to a.stamps.
template <GemvWeight W, int MT, int kCtasPerSm, bool kStamps = false>
__global__ void __launch_bounds__(kGemvThreads, kCtasPerSm) gemv_kernel(const __grid_constant__ GemvArgs a) {
  using Kind = GemvKind<W>;
  auto stamp = [&](int at) {
    if constexpr (kStamps)
      if (threadIdx.x == 0)
        a.stamps[(size_t(blockIdx.y) * gridDim.x + blockIdx.x) * kSmallMStampCount + at] = global_timer_ns();
  };
  stamp(kStampEntry);
  constexpr int T = 8 * MT;
  constexpr int kStage = kStageK<W>;
  extern __shared__ __align__(16) uint32_t smem[];

  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int kc = int(a.k / a.splits);
  const int64_t k0 = int64_t(blockIdx.y) * kc;
  const int64_t row0 = int64_t(blockIdx.x) * kGemvCtaRows;
  const int64_t group = row0 / a.group_rows;
  const int xstride = kc / 2 + Kind::kPadWords;
  uint32_t* xs = smem;
  const int xs_words = T * xstride;
  float* xsc = reinterpret_cast<float*>(smem + (xs_words > T * kCtStride ? xs_words : T * kCtStride));

  // This thread's two weight rows (clamped into the matrix; rows past n are never written).
  const int64_t ra = row0 + 16 * warp + g;
  const int64_t rbw = ra + 8;
  const uint8_t* wbase = static_cast<const uint8_t*>(a.w);
  const int64_t row_bytes = a.k * Kind::kElemBytes;
  const uint8_t* wa = wbase + (ra < a.n ? ra : a.n - 1) * row_bytes + k0 * Kind::kElemBytes + 16 * t;
  const uint8_t* wb = wbase + (rbw < a.n ? rbw : a.n - 1) * row_bytes + k0 * Kind::kElemBytes + 16 * t;
  // A stage's weight scale (its 128-wide k block) is loaded with its weight
  // into the same ring. Read where the stage needs it, each was a dependent
  // load (Nsight Compute put a quarter of wq_b's stall samples on it);
  // staged in shared memory before the wait, it held the CTA's first barrier
  // until it came back, behind the first stages' weight (AF1).
  const float* wscale = Kind::kScaled ? a.w_scales + int64_t(blockIdx.x) * a.w_scale_ld + k0 / 128 : nullptr;

  float acc[MT][4];
#pragma unroll
  for (int j = 0; j < MT; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.0f;

  auto load_stage = [&](uint4 (&v)[4], float& sw, int st) {
    const int64_t off = int64_t(st) * kStage * Kind::kElemBytes;
    constexpr int64_t kChunkBytes = Kind::kChunkK * Kind::kElemBytes;
    v[0] = load_weight16(wa + off);
    v[1] = load_weight16(wb + off);
    v[2] = load_weight16(wa + off + kChunkBytes);
    v[3] = load_weight16(wb + off + kChunkBytes);
    if constexpr (Kind::kScaled) sw = __ldg(wscale + st);
  };

  auto compute_stage = [&](const uint4 (&v)[4], float sw, int st) {
    float cb[MT][4];  // this 128-block's sums (scaled kinds)
#pragma unroll
    for (int j = 0; j < MT; ++j) cb[j][0] = cb[j][1] = cb[j][2] = cb[j][3] = 0.0f;
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      const uint4 va = v[2 * c], vb = v[2 * c + 1];
      // First word of this thread's k group in an activation row.
      const int w0 = 2 * ((st * kStage + c * Kind::kChunkK + (Kind::kChunkK / 4) * t) / 4);
      if constexpr (Kind::kElemBytes == 1) {
#pragma unroll
        for (int s = 0; s < 4; ++s) {
          const uint32_t ua = word_of(va, s), ub = word_of(vb, s);
          uint32_t af[4];
          if constexpr (Kind::kBf16Mma) {
            af[0] = e4m3_even_bf16(ua), af[1] = e4m3_even_bf16(ub), af[2] = e4m3_odd_bf16(ua), af[3] = e4m3_odd_bf16(ub);
          } else {
            af[0] = e4m3_even_f16(ua), af[1] = e4m3_even_f16(ub), af[2] = e4m3_odd_f16(ua), af[3] = e4m3_odd_f16(ub);
          }
#pragma unroll
          for (int j = 0; j < MT; ++j) {
            const uint2 xb = *reinterpret_cast<const uint2*>(xs + (8 * j + g) * xstride + w0 + 2 * s);
            mma16816<Kind::kBf16Mma>(cb[j], af, xb.x, xb.y);
          }
        }
      } else {
#pragma unroll
        for (int j = 0; j < MT; ++j) {
          const uint4 xb = *reinterpret_cast<const uint4*>(xs + (8 * j + g) * xstride + w0);
#pragma unroll
          for (int s = 0; s < 2; ++s) {
            const uint32_t af[4] = {word_of(va, 2 * s), word_of(vb, 2 * s), word_of(va, 2 * s + 1),
                                    word_of(vb, 2 * s + 1)};
            mma16816<true>(acc[j], af, word_of(xb, 2 * s), word_of(xb, 2 * s + 1));
          }
        }
      }
    }
    if constexpr (Kind::kScaled) {
#pragma unroll
      for (int j = 0; j < MT; ++j) {
        float s0 = sw, s1 = sw;
        if constexpr (W == GemvWeight::kFp8) {  // 2^16 undoes the decoders' 2^-8 on both sides
          const int kbc = kc / 128;
          s0 = xsc[(8 * j + 2 * t) * kbc + st] * sw * 65536.0f;
          s1 = xsc[(8 * j + 2 * t + 1) * kbc + st] * sw * 65536.0f;
        }
        acc[j][0] = fmaf(cb[j][0], s0, acc[j][0]);
        acc[j][1] = fmaf(cb[j][1], s1, acc[j][1]);
        acc[j][2] = fmaf(cb[j][2], s0, acc[j][2]);
        acc[j][3] = fmaf(cb[j][3], s1, acc[j][3]);
      }
    }
  };

  // kGemvDepth stages in flight: stage st lives in buf[st % kGemvDepth]. The
  // first loads do not need the activation: all but the last slot's fly
  // before the wait (the previous kernel's CTAs may still hold the memory
  // system), the last slot's right after it, while the activation is staged
  // (so no stage waits for the staging's barrier to be requested).
  const int stages = kc / kStage;
  uint4 buf[kGemvDepth][4];
  float sbuf[kGemvDepth] = {};
#pragma unroll
  for (int i = 0; i < kGemvDepth - 1; ++i)
    if (i < stages) load_stage(buf[i], sbuf[i], i);
  pdl_start();  // pdl.cuh: the weights above are read while the previous kernel ends
  stamp(kStampWaited);
  if (kGemvDepth - 1 < stages) load_stage(buf[kGemvDepth - 1], sbuf[kGemvDepth - 1], kGemvDepth - 1);
  stage_activation<W, T>(a, xs, xstride, xsc, kc, group * a.k + k0);
  __syncthreads();
  stamp(kStampStaged);
  for (int base = 0; base < stages; base += kGemvDepth) {
#pragma unroll
    for (int i = 0; i < kGemvDepth; ++i) {
      const int st = base + i;
      if (st < stages) {
        const int next = st + kGemvDepth - 1;  // into the slot stage st - 1 left (stage kGemvDepth - 1: loaded above)
        if (st > 0 && next < stages) {
          const int slot = (i + kGemvDepth - 1) % kGemvDepth;  // unrolled: a constant
          load_stage(buf[slot], sbuf[slot], next);
        }
        compute_stage(buf[i], sbuf[i], st);
      }
    }
  }

  // The tile [T activation rows][128 weight rows] in shared memory, over the activation slice.
  __syncthreads();
  stamp(kStampLooped);
  float* ct = reinterpret_cast<float*>(smem);
#pragma unroll
  for (int j = 0; j < MT; ++j)
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int e = 0; e < 2; ++e) ct[(8 * j + 2 * t + e) * kCtStride + 16 * warp + g + 8 * h] = acc[j][2 * h + e];
  __syncthreads();
  bool writer = true;
  if (a.cluster_sum) {  // each CTA of the cluster sums and writes its share of the rows
    sum_cluster_rows(a, ct, int(blockIdx.y));
    stamp(kStampSummed);
    write_outputs(a, ct, int(blockIdx.y), a.splits);
  } else {  // the last CTA of the row block to arrive sums and writes every row; the others leave
    writer = a.splits == 1 || reduce_splits(a, ct, int(blockIdx.y), int(blockIdx.x), int(gridDim.x));
    stamp(kStampSummed);
    if (writer) write_outputs(a, ct, 0, 1);
  }
  stamp(kStampWritten);
  if (!writer) return;
  if constexpr (W == GemvWeight::kFp8) {
    if (a.cluster_sum) run_tail(a, int(blockIdx.x), int(gridDim.x), a.splits, int(blockIdx.y), a.splits, smem);
    else run_tail(a, int(blockIdx.x), int(gridDim.x), 1, 0, 1, smem);
  }
}

// Clusters of 2, 4 and 8 CTAs along y ([1 .. 3]) that an instantiation holds
// resident at once with its largest shared-memory slice (gemv_configure_mt).
template <GemvWeight W, int MT, int kCtasPerSm, bool kStamps = false>
inline int gemv_max_clusters[4] = {};

// The buffer of set_small_m_stamps (nullptr: off); read at launch, so a
// captured graph keeps the value it was captured with.
extern unsigned long long* g_small_m_stamps;
// Whether the diagnostics instantiation exists for this kind and tile:
// wo_a's products of up to 8 rows (two CTAs an SM).
template <GemvWeight W, int MT>
inline constexpr bool kGemvHasStamps = W == GemvWeight::kW8A16 && MT == 1;

// Launch of one instantiation (the host code checked the arguments). The
// splits of a row block sum in a cluster where every row block's cluster
// fits at once (a portable cluster: up to 8), else through the workspace;
// returns whether in a cluster.
template <GemvWeight W, int MT, int kCtasPerSm, bool kStamps = false>
bool gemv_launch_cps(GemvArgs a, int64_t nrb, size_t smem, cudaStream_t stream) {
  const int ci = cluster_size_index(a.splits);
  a.cluster_sum = ci > 0 && nrb <= gemv_max_clusters<W, MT, kCtasPerSm, kStamps>[ci];
  a.stamps = kStamps ? g_small_m_stamps : nullptr;
  const dim3 grid(unsigned(nrb), unsigned(a.splits));
  pdl_launch_clustered(gemv_kernel<W, MT, kCtasPerSm, kStamps>, grid, kGemvThreads, smem, stream,
                       dim3(1, a.cluster_sum ? unsigned(a.splits) : 1u), a);
  return a.cluster_sum;
}
template <GemvWeight W, int MT>
bool gemv_launch_mt(const GemvArgs& a, cudaStream_t stream) {
  const int64_t nrb = (a.n + kGemvCtaRows - 1) / kGemvCtaRows;
  size_t smem = gemv_smem_bytes<W>(8 * MT, a.k / a.splits);
  if (a.q_head.counters != nullptr) smem = std::max(smem, sizeof(QHeadSmem));
  if (a.residual.counter != nullptr) smem = std::max(smem, size_t(a.m) * size_t(nrb) * sizeof(double));
  if constexpr (MT == 1) {
    if (nrb * a.splits > int64_t(kGemvCtasPerSm<MT>) * device_sm_count())
      return gemv_launch_cps<W, MT, kGemvDenseCtasPerSm>(a, nrb, smem, stream);
  }
  if constexpr (kGemvHasStamps<W, MT>) {
    if (g_small_m_stamps != nullptr) return gemv_launch_cps<W, MT, kGemvCtasPerSm<MT>, true>(a, nrb, smem, stream);
  }
  return gemv_launch_cps<W, MT, kGemvCtasPerSm<MT>>(a, nrb, smem, stream);
}

// Allows the largest shared-memory slice this instantiation can be launched
// with, and counts its resident clusters at that slice.
template <GemvWeight W, int MT, int kCtasPerSm = kGemvCtasPerSm<MT>, bool kStamps = false>
cudaError_t gemv_configure_mt() {
  size_t smem = gemv_smem_bytes<W>(8 * MT, gemv_max_cta_k(8 * MT));
  if constexpr (W == GemvWeight::kFp8) smem = std::max({smem, sizeof(QHeadSmem), kResidualTailSmem});
  auto* kernel = gemv_kernel<W, MT, kCtasPerSm, kStamps>;
  cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem));
  for (int i = 1; i < 4 && e == cudaSuccess; ++i)
    e = max_active_clusters(kernel, dim3(1, 1u << i), kGemvThreads, smem,
                            &gemv_max_clusters<W, MT, kCtasPerSm, kStamps>[i]);
  if constexpr (kGemvHasStamps<W, MT> && kCtasPerSm == kGemvCtasPerSm<MT> && !kStamps) {
    if (e == cudaSuccess) e = gemv_configure_mt<W, MT, kCtasPerSm, true>();
  }
  return e;
}

template <GemvWeight W>
bool gemv_launch_kind(const GemvArgs& a, cudaStream_t stream) {
  switch (gemv_tile_rows(a.m)) {
    case 8: return gemv_launch_mt<W, 1>(a, stream);
    case 16: return gemv_launch_mt<W, 2>(a, stream);
    case 32: return gemv_launch_mt<W, 4>(a, stream);
    default: return gemv_launch_mt<W, 8>(a, stream);
  }
}

template <GemvWeight W>
cudaError_t gemv_configure_kind() {
  cudaError_t e = gemv_configure_mt<W, 1>();
  if (e == cudaSuccess) e = gemv_configure_mt<W, 1, kGemvDenseCtasPerSm>();
  if (e == cudaSuccess) e = gemv_configure_mt<W, 2>();
  if (e == cudaSuccess) e = gemv_configure_mt<W, 4>();
  if (e == cudaSuccess) e = gemv_configure_mt<W, 8>();
  return e;
}

// Defined in linear_gemv_{fp8,w8a16,bf16}.cu; whether the splits were summed in a cluster.
bool gemv_launch_fp8(const GemvArgs& a, cudaStream_t stream);
bool gemv_launch_w8a16(const GemvArgs& a, cudaStream_t stream);
bool gemv_launch_bf16(const GemvArgs& a, cudaStream_t stream);
cudaError_t gemv_configure_fp8();
cudaError_t gemv_configure_w8a16();
cudaError_t gemv_configure_bf16();
// Allows the FP8 GEMM's shared memory and counts the clusters of each of
// its tiles that fit at once (linear_gemm.cu).
cudaError_t gemm_configure();

}  // namespace dsv4::cuda::detail
