// C4A's quad kernel (compressor_internal.cuh, compressor_cuda.cu's rule).
#include "attn/cuda/compressor_internal.cuh"
#include "attn/cuda/pdl.cuh"
#include "attn/cuda/ptx.cuh"

namespace dsv4::cuda {
namespace {

// C4A's compressors in a kRuns step (m = 4) on groups of kDim / 4 threads
// (the main compressor's 128 a CTA, the indexer's 32, four a CTA), each over
// kQuadTokens tokens: the group writes their rows (those a later token
// reads) and pools the entries they complete (one; up to four where runs
// meet) one after another. Thread i holds channels 4i .. 4i + 3 from the
// pool's loads to the record, so no channel goes through another thread,
// and the indexer's group syncs as a warp. The pool's loads are cp.async
// copies into the thread's own stage in shared memory, all in flight at
// once: held in registers (125 of them) they allowed 4 CTAs an SM, and the
// compiler serialized the ape rows' loads. (span_kernel's CTA of c threads,
// one channel a thread, pooled through shared memory at two CTAs an SM.)
constexpr int kQuadThreads = 128, kQuadTokens = 4, kQuadRows = 8;  // m = 4 pools two blocks
// Groups a CTA of the quad kernel for c = dim: 1 (main), 4 (indexer).
__host__ __device__ constexpr int quad_groups(int dim) { return kQuadThreads / (dim / 4); }
constexpr int kQuadCtas = 6;  // an SM: the stages' 32 KB a CTA

// A thread's stage: float4 (row b, half h: 0 a, 1 g) at [b][h][threadIdx.x],
// so a warp's 16-byte accesses are consecutive.
using QuadStage = float4[kQuadRows][2][kQuadThreads];

// Thread i's channels col .. col + 3 of entry e's rows (rows_s, apes_s as
// plan_entry sets them; rows of block j at b_off further) into its stage;
// returns the rows present (bit b). The caller waits for the copies.
__device__ __forceinline__ unsigned stage_quad(QuadStage& stage, const float* const* rows_s, const EntryPlan& e,
                                               int b_off, int kc, int col) {
  const int b_from = e.own_from(4);
  unsigned present = 0;
#pragma unroll
  for (int b = 0; b < kQuadRows; ++b) {
    const float* r = b < e.n ? rows_s[b] : nullptr;
    if (r == nullptr) continue;
    present |= 1u << b;
    const float* x = r + pool::half_offset(b, b_from, b_off) + col;
    cp_async_16(smem_u32(&stage[b][0][threadIdx.x]), x, 16);
    cp_async_16(smem_u32(&stage[b][1][threadIdx.x]), x + kc, 16);
  }
  cp_async_commit();
  return present;
}

// Row b's gates from the stage, with its ape row added where it has one (the
// state row's sum: the same bits).
__device__ __forceinline__ float4 staged_gates(const QuadStage& stage, const float* const* apes_s, int b,
                                               int b_from, int b_off, int col) {
  const float4 g = stage[b][1][threadIdx.x];
  const float* ape = apes_s[b];
  return ape ? add_rn(g, __ldg(reinterpret_cast<const float4*>(ape + pool::half_offset(b, b_from, b_off) + col))) : g;
}

// pool_channel's operations (compressor_math.h) on entry e's staged
// channels: each channel's maximum over the present rows (the gates with
// their ape rows added go back to the stage, so each ape row is read once),
// then its weights and sums in row order.
__device__ __forceinline__ float4 pool_quad(QuadStage& stage, const float* const* apes_s, const EntryPlan& e,
                                            unsigned present, int b_off, int col) {
  const int b_from = e.own_from(4);
  const float kNegInf = -__int_as_float(0x7f800000);
  float mx[4] = {kNegInf, kNegInf, kNegInf, kNegInf}, den[4] = {}, num[4] = {};
#pragma unroll
  for (int b = 0; b < kQuadRows; ++b) {
    if (!(present >> b & 1)) continue;
    const float4 g4 = staged_gates(stage, apes_s, b, b_from, b_off, col);
    if (apes_s[b]) stage[b][1][threadIdx.x] = g4;
    const float g[4] = {g4.x, g4.y, g4.z, g4.w};
#pragma unroll
    for (int c = 0; c < 4; ++c) mx[c] = mx[c] < g[c] ? g[c] : mx[c];
  }
#pragma unroll
  for (int b = 0; b < kQuadRows; ++b) {
    if (!(present >> b & 1)) continue;
    const float4 g4 = stage[b][1][threadIdx.x], a4 = stage[b][0][threadIdx.x];
    const float g[4] = {g4.x, g4.y, g4.z, g4.w}, a[4] = {a4.x, a4.y, a4.z, a4.w};
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      const float w = pool::exp_f32(pool::fsub(g[c], mx[c]));
      den[c] = pool::fadd(den[c], w);
      num[c] = pool::fadd(num[c], pool::fmul(w, a[c]));
    }
  }
  return make_float4(pool::fdiv(num[0], den[0]), pool::fdiv(num[1], den[1]), pool::fdiv(num[2], den[2]),
                     pool::fdiv(num[3], den[3]));
}

// A barrier of one quad group: a warp, or the whole CTA.
template <int kGroup>
__device__ __forceinline__ void group_sync() {
  if constexpr (kGroup == 32)
    __syncwarp();
  else
    __syncthreads();
}

template <int kDim>
__global__ void __launch_bounds__(kQuadThreads, kQuadCtas)
    quad_kernel(const CompressorParams p, const __grid_constant__ EntryArgs args) {
  constexpr int kGroup = kDim / 4, kGroups = quad_groups(kDim);
  static_assert(kGroup == 32 || kGroup == kQuadThreads, "a group is a warp or the CTA");
  __shared__ QuadStage stage;
  __shared__ const float* rows_s[kGroups][kQuadRows];
  __shared__ const float* apes_s[kGroups][kQuadRows];
  __shared__ float* dst_s[kGroups][kQuadTokens];
  __shared__ const float* tape_s[kGroups][kQuadTokens];
  __shared__ unsigned ends_s[kGroups], lives_s[kGroups];
  __shared__ double red_s[kQuadThreads / 32];
  const int g = int(threadIdx.x) / kGroup, i = int(threadIdx.x) % kGroup, col = 4 * i;
  const int t0 = (int(blockIdx.x) * kGroups + g) * kQuadTokens, n = max(0, min(kQuadTokens, p.num_tokens - t0));
  // The metadata, before the wait: the rows (and which the group writes),
  // the tokens that complete an entry, the first entry's plan.
  if (i < 32) {  // the group's first warp
    float* dst = i < n ? state_row(p, __ldg(p.row_slot + t0 + i)) : nullptr;
    if (i < n) dst_s[g][i] = dst, tape_s[g][i] = ape_row(p, t0 + i);
    const unsigned lives = __ballot_sync(0xffffffffu, dst != nullptr);
    const unsigned ends = __ballot_sync(0xffffffffu, i < n && entry_of(p, t0 + i).page != nullptr);
    if (i == 0) ends_s[g] = ends, lives_s[g] = lives;
  }
  group_sync<kGroup>();
  unsigned ends = ends_s[g];
  const int b_off = kDim, kc = p.kc();  // m = 4: rows of block j pool their B half
  EntryPlan e;
  if (ends) {
    e = plan_entry(p, args.rope.inv_freq, t0 + __ffs(ends) - 1, i, kGroup, rows_s[g], nullptr, kDim, apes_s[g]);
    group_sync<kGroup>();  // rows_s, apes_s
  }
  pdl_start();  // pdl.cuh: launched with pdl_launch
  unsigned present = ends ? stage_quad(stage, rows_s[g], e, b_off, kc, col) : 0;
  if (lives_s[g]) write_span_rows<kGroup>(p, i, t0, n, dst_s[g], tape_s[g]);  // while the copies fly
  while (ends) {
    cp_async_wait_group<0>();  // the thread's own stage: no barrier
    float y[4];
    round_pooled(pool_quad(stage, apes_s[g], e, present, b_off, col), y);
    double ss = sum_squares4(y);
    if constexpr (kGroup == 32) {
      ss = group_sum<32>(ss);  // red_sum of the warp's one partial: the same bits
    } else {
      warp_partial(ss, red_s);
      __syncthreads();
      ss = red_sum(red_s, 0, kGroup / 32);
    }
    store_entry<kDim>(p, args, e, i, rms_inv(ss, kDim, p.eps), e.cs, y);
    ends &= ends - 1;
    if (!ends) break;
    group_sync<kGroup>();  // every thread has read rows_s, apes_s and red_s
    e = plan_entry(p, args.rope.inv_freq, t0 + __ffs(ends) - 1, i, kGroup, rows_s[g], nullptr, kDim, apes_s[g]);
    group_sync<kGroup>();  // rows_s, apes_s
    present = stage_quad(stage, rows_s[g], e, b_off, kc, col);
  }
}

}  // namespace

// quad_kernel: a group of kQuadTokens tokens, quad_groups(c) of them a CTA.
void launch_quad(const CompressorParams& p, const EntryArgs& args, CUstream_st* stream) {
  const unsigned groups = unsigned((p.num_tokens + kQuadTokens - 1) / kQuadTokens);
  const unsigned per_cta = unsigned(quad_groups(p.dim)), ctas = (groups + per_cta - 1) / per_cta;
  if (p.dim == kKvDim)
    pdl_launch(quad_kernel<kKvDim>, ctas, kQuadThreads, 0, stream, p, args);
  else
    pdl_launch(quad_kernel<kIndexDim>, ctas, kQuadThreads, 0, stream, p, args);
}

}  // namespace dsv4::cuda
