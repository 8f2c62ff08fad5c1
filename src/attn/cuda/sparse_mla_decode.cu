// Sparse MLA attention for decode steps: a few tokens whose rows are short
// (SPEC §4.6). Same semantics and numerics as the tile kernel
// (sparse_mla_kernel.cu); SparseAttentionCuda::run() picks this one for
// calls of few tokens with rows of at most kDecodeMaxEntries entries
// (SparseAttentionCudaLimits: decode_max_*).
//
// Why a second kernel. At one token the tile kernel's work is a handful of
// 64-entry tiles: a few of its persistent CTAs (226 KB of shared memory each,
// so none becomes resident while the previous kernel holds its SM) run one
// tile each for all 64 heads, write 128 KB of fp32 partials apiece, and a
// second kernel merges them. Here the work is cut the other way: CTA
// (s, g, t) runs the 16 heads of group g (one m16 tile of mma.sync) of token
// t over split s of the row's entries. The splits of a (token, group) are
// one cluster and merge through distributed shared memory: no partials in
// global memory, no second kernel.
//
// A CTA of W warps (4, 8 or 16: Shape<W>) runs chunks of 8 W entries: its
// threads gather and dequantize the records into bf16 rows (a quarter record
// per thread, as the tile kernel's producer); warp w computes S for entries
// 8w..8w+7 of the 16 heads; the warps exchange row maxima through shared
// memory and write P (bf16); warp w computes O += P V for its 512 / W dims.
// The first chunk's records load into registers; the later chunks' are
// copied into shared memory at the same time (cp.async), so that they arrive
// while the first is computed instead of one chunk ahead (a further chunk
// took 2.7 us that way, most of it waiting for its records: run AG2). More
// warps mean fewer splits and CTAs for the same row (SparseAttentionCuda::
// decode_warps says which the engine takes).
//
// Numerics as the tile kernel: q.k with bf16 operands and fp32 accumulation
// in two chains (even and odd k steps), scaled after; exp2 in fp32; P rounded
// to bf16 for P V while the row sum adds the fp32 values; the splits merged
// against their common maximum in rank order (deterministic); the output
// rounded to bf16, then rotated (AttnParams::rope_cs).
#include <algorithm>

#include "attn/cuda/pdl.cuh"
#include "attn/cuda/sparse_mla_common.cuh"

namespace dsv4::cuda {
namespace {

using namespace mla;

constexpr int kHeads = 16;       // heads per CTA: the m16 of mma.sync
constexpr int kRowBytes = 1024;  // a bf16 row of 512 dims
constexpr int kORow = 512 + 8;   // floats of an O row after the chunks; the padding spreads the rows' stores over banks

// The shape of an instantiation of W warps: chunks of 8 W entries (8 a warp
// in S), each warp 512 / W dims of P V.
template <int W>
struct Shape {
  static constexpr int kThreads = 32 * W;
  static constexpr int kChunk = 8 * W;
  static constexpr int kDims = 512 / W;              // P V dims a warp
  static constexpr int kTiles = kDims / 8;           // its n8 tiles
  static constexpr int kPRow = 2 * kChunk + 16;      // bytes of a P row: padded to an odd number of 16-byte chunks (conflict-free ldmatrix)
  // Shared memory.
  static constexpr int kSmQ = 0;                             // Q: 16 rows
  static constexpr int kSmK = kSmQ + kHeads * kRowBytes;     // K (= V): a chunk's rows
  static constexpr int kSmP = kSmK + kChunk * kRowBytes;     // P: 16 rows
  static constexpr int kSmMask = kSmP + kHeads * kPRow;      // [kChunk] entry valid
  static constexpr int kSmRed = kSmMask + kChunk;            // [W warps][16 rows] floats: maxima, then sums
  static constexpr int kSmStats = kSmRed + W * kHeads * 4;   // [16] {m, l} of this split
  // 16 warps: pairs split S's two chains (scores); each lane hands its
  // partner a fragment (4 floats).
  static constexpr bool kPairs = W == 16;
  static constexpr int kSmPair = kSmStats + kHeads * 8;
  static constexpr int kSmBytes = kSmPair + (kPairs ? kThreads * 16 : 0);
  // Then, for chunks 1.. of the split, the staged records (sized at launch):
  // a chunk's records, then each thread's copy of its entry's scale bytes.
  static constexpr int kStageRecords = kChunk * 576;
  static constexpr int kStageBytes = kStageRecords + kThreads * 8;
  static constexpr int kMaxChunks = kDecodeMaxEntries / (kDecodeMaxSplits * kChunk);  // chunks of a split at most
  // After the chunks: this split's unnormalised fp32 O, over Q and K.
  static constexpr int kSmO = 0;
  static_assert(kSmO + kHeads * kORow * 4 <= kSmP, "O fits over Q and K");
  static_assert(kSmBytes % 16 == 0 && kStageBytes % 16 == 0, "16-byte copies");
  static_assert(kMaxChunks >= 1 && kMaxChunks <= 4, "cp_async_wait_pending covers up to 3 staged chunks");
  // Byte offset of chunk k's stage (k >= 1); the shared memory of a launch
  // whose splits run up to `chunks` chunks ends where chunk `chunks` would start.
  static constexpr int stage_off(int k) { return kSmBytes + (k - 1) * kStageBytes; }
  static constexpr int smem_bytes(int chunks) { return stage_off(chunks); }
};

// Byte offset of 16-byte chunk c (8 dims) of row r: rows of 1024 bytes, the
// chunk's low three bits XOR the row's, so that ldmatrix's eight rows of one
// chunk column hit eight different bank groups.
__device__ __forceinline__ uint32_t row_chunk(int r, int c) { return uint32_t(r * kRowBytes + ((c ^ (r & 7)) << 4)); }

// S = Q K^T for the 16 heads and warp w's entries 8w..8w+7 (fragment: rows
// g, g + 8; entries 8w + 2 q4, + 1), in two chains of k steps (even and
// odd), added at the end.
template <int W>
__device__ __forceinline__ void scores(uint32_t sbase, uint8_t* smem, int warp, int lane, float (&s)[4]) {
  using Sh = Shape<W>;
  // ldmatrix rows: A (Q) matrix i = lane / 8 is rows 8 (i & 1) + lane % 8 of
  // chunk column i / 2.
  const int a_row = (lane & 7) + 8 * ((lane >> 3) & 1), a_col = lane >> 4;
  if constexpr (!Sh::kPairs) {
    float sd[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    s[0] = s[1] = s[2] = s[3] = 0.0f;
    // B (K) matrix i is chunk column i of entries 8w + lane % 8.
    const int b_row = 8 * warp + (lane & 7), b_col = lane >> 3;
#pragma unroll
    for (int kp = 0; kp < 16; ++kp) {  // k steps 2 kp (chunks 4 kp, + 1) and 2 kp + 1 (chunks 4 kp + 2, + 3)
      uint32_t bk[4], aq[4];
      ldmatrix_x4(bk, sbase + Sh::kSmK + row_chunk(b_row, 4 * kp + b_col));
      ldmatrix_x4(aq, sbase + Sh::kSmQ + row_chunk(a_row, 4 * kp + a_col));
      mma_bf16_16816(s, aq, bk[0], bk[1]);
      ldmatrix_x4(aq, sbase + Sh::kSmQ + row_chunk(a_row, 4 * kp + 2 + a_col));
      mma_bf16_16816(sd, aq, bk[2], bk[3]);
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) s[i] += sd[i];
  } else {
    // Warps 2i and 2i + 1 take entries 16i..16i+15 (two n8 tiles), warp 2i
    // the even chain, 2i + 1 the odd: each reads half of Q, where one warp
    // for each 8 entries would read all of it (16 KB; with 16 warps the
    // shared-memory reads of Q were most of the chunk's). Then warp c of
    // the pair keeps tile c: the partner's chain of it comes through shared
    // memory, and the sum is even + odd as above.
    const int c = warp & 1, e0 = 8 * (warp & ~1);
    // B matrix i is tile i / 2 (entries e0 + 8 (i / 2) + lane % 8), chunk column i % 2 of the k step.
    const int b_row = e0 + 8 * ((lane >> 4) & 1) + (lane & 7), b_col = (lane >> 3) & 1;
    float t0[4] = {0.0f, 0.0f, 0.0f, 0.0f}, t1[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
    for (int kp = 0; kp < 16; ++kp) {  // k step 2 kp + c: chunks 4 kp + 2c, + 1
      uint32_t bk[4], aq[4];
      ldmatrix_x4(bk, sbase + Sh::kSmK + row_chunk(b_row, 4 * kp + 2 * c + b_col));
      ldmatrix_x4(aq, sbase + Sh::kSmQ + row_chunk(a_row, 4 * kp + 2 * c + a_col));
      mma_bf16_16816(t0, aq, bk[0], bk[1]);
      mma_bf16_16816(t1, aq, bk[2], bk[3]);
    }
    float4* pair = reinterpret_cast<float4*>(smem + Sh::kSmPair);
    pair[warp * 32 + lane] = c == 0 ? make_float4(t1[0], t1[1], t1[2], t1[3]) : make_float4(t0[0], t0[1], t0[2], t0[3]);
    bar_sync(1 + (warp >> 1), 64);  // the pair's barrier (0 is __syncthreads)
    const float4 o = pair[(warp ^ 1) * 32 + lane];
    if (c == 0) {  // tile 0: this warp's even chain + the partner's odd
      s[0] = t0[0] + o.x, s[1] = t0[1] + o.y, s[2] = t0[2] + o.z, s[3] = t0[3] + o.w;
    } else {  // tile 1: the partner's even chain + this warp's odd
      s[0] = o.x + t1[0], s[1] = o.y + t1[1], s[2] = o.z + t1[2], s[3] = o.w + t1[3];
    }
  }
}

// O += P V for warp w's dims D w .. D w + D - 1 (D = 512 / W) over the
// chunk's entries (acc[j]: rows g, g + 8; dims D w + 8j + 2 q4, + 1).
template <int W>
__device__ __forceinline__ void add_pv(uint32_t sbase, int warp, int lane, float (&acc)[Shape<W>::kTiles][4]) {
  using Sh = Shape<W>;
  const int a_row = (lane & 7) + 8 * ((lane >> 3) & 1), a_col = lane >> 4;
#pragma unroll
  for (int kk = 0; kk < Sh::kChunk / 16; ++kk) {  // entries 16 kk .. 16 kk + 15
    uint32_t ap[4];
    ldmatrix_x4(ap, sbase + Sh::kSmP + a_row * Sh::kPRow + (2 * kk + a_col) * 16);
    // V transposed: matrix i is entries 16 kk + 8 (i & 1) + lane % 8 of
    // chunk column (D / 8) w + 2 jp + i / 2.
    const int v_row = 16 * kk + a_row;
#pragma unroll
    for (int jp = 0; jp < Sh::kTiles / 2; ++jp) {
      uint32_t bv[4];
      ldmatrix_x4_trans(bv, sbase + Sh::kSmK + row_chunk(v_row, Sh::kTiles * warp + 2 * jp + a_col));
      mma_bf16_16816(acc[2 * jp], ap, bv[0], bv[1]);
      mma_bf16_16816(acc[2 * jp + 1], ap, bv[2], bv[3]);
    }
  }
}

// The splits' merge: this CTA's items of the (token, group)'s output, each
// a float4 of a head row, merged over the S splits' O and {m, l} in rank
// order (SPEC §4.6: o = sum w_r O_r / (L + 2^(sink log2 e - M))). The CTA
// owns heads rank, rank + S, ...; thread i takes float4 i % 128 of its
// (i / 128)-th head of each W / 4 of them. Every load of every item is
// issued before any is used: distributed shared memory answers in about
// 0.2 us, and loads one after another cost that each (runs AG2-AG3).
template <int W, int S>
__device__ __forceinline__ void merge_splits(const AttnParams& p, const uint8_t* smem, uint32_t sbase, int t,
                                             int head0, int rank) {
  using Sh = Shape<W>;
  constexpr int kRopeF4 = 448 / 4;  // the first float4 of the rotary dims
  constexpr int kLanes = W / 4;     // heads a round: 128 threads each
  constexpr int kItems = ((kHeads + S - 1) / S + kLanes - 1) / kLanes;
  const int f = int(threadIdx.x) & 127, sub = int(threadIdx.x) >> 7, heads = min(kHeads, p.num_heads - head0);
  float4 v[kItems][S];
  float2 ml[kItems][S];
#pragma unroll
  for (int i = 0; i < kItems; ++i) {
    const int h = rank + (i * kLanes + sub) * S;
    if (h >= heads) break;  // padded heads: no output
    const uint32_t o_off = Sh::kSmO + 4 * (h * kORow + 4 * f), s_off = Sh::kSmStats + 8 * h;
#pragma unroll
    for (int r = 0; r < S; ++r) {
      if constexpr (S == 1) {
        v[i][r] = *reinterpret_cast<const float4*>(smem + o_off);
        ml[i][r] = *reinterpret_cast<const float2*>(smem + s_off);
      } else {
        v[i][r] = ld_cluster_f4(map_to_cta(sbase + o_off, uint32_t(r)));
        ml[i][r] = ld_cluster_f2(map_to_cta(sbase + s_off, uint32_t(r)));
      }
    }
  }
#pragma unroll
  for (int i = 0; i < kItems; ++i) {
    const int h = rank + (i * kLanes + sub) * S;
    if (h >= heads) break;
    float mx = -INFINITY;
#pragma unroll
    for (int r = 0; r < S; ++r) mx = fmaxf(mx, ml[i][r].x);
    const float base = mx == -INFINITY ? 0.0f : mx;  // nothing attended: every weight is 0
    float l = 0.0f;
    float4 o = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
    for (int r = 0; r < S; ++r) {
      const float w = fast_exp2(ml[i][r].x - base);
      l += w * ml[i][r].y;
      o = make_float4(o.x + w * v[i][r].x, o.y + w * v[i][r].y, o.z + w * v[i][r].z, o.w + w * v[i][r].w);
    }
    // mx = -inf: exp2(+inf) = inf, inv = 0, o = 0.
    const float inv = 1.0f / (l + fast_exp2(p.sink[head0 + h] * kLog2e - mx));
    uint2 word = make_uint2(pack_bf16(o.x * inv, o.y * inv), pack_bf16(o.z * inv, o.w * inv));
    if (p.rope_cs != nullptr && f >= kRopeF4) {
      const float4 cs = __ldg(reinterpret_cast<const float4*>(p.rope_cs + int64_t(t) * 32 + 2 * (f - kRopeF4)));
      word = make_uint2(rope_rotate_bf16x2(word.x, make_float2(cs.x, cs.y)),
                        rope_rotate_bf16x2(word.y, make_float2(cs.z, cs.w)));
    }
    const int64_t row = int64_t(t) * p.num_heads + head0 + h;
    *reinterpret_cast<uint2*>(p.out + row * 512 + 4 * f) = word;
    if (f == 0 && p.lse != nullptr) p.lse[row] = l > 0.0f ? mx * kLn2 + logf(l) : -INFINITY;
  }
}

// merge_splits for the launch's split count (1 .. kDecodeMaxSplits).
template <int W>
__device__ __forceinline__ void merge(const AttnParams& p, const uint8_t* smem, uint32_t sbase, int t, int head0,
                                      int rank, int splits) {
  static_assert(kDecodeMaxSplits == 8, "one case a split count");
  switch (splits) {
    case 1: merge_splits<W, 1>(p, smem, sbase, t, head0, rank); break;
    case 2: merge_splits<W, 2>(p, smem, sbase, t, head0, rank); break;
    case 3: merge_splits<W, 3>(p, smem, sbase, t, head0, rank); break;
    case 4: merge_splits<W, 4>(p, smem, sbase, t, head0, rank); break;
    case 5: merge_splits<W, 5>(p, smem, sbase, t, head0, rank); break;
    case 6: merge_splits<W, 6>(p, smem, sbase, t, head0, rank); break;
    case 7: merge_splits<W, 7>(p, smem, sbase, t, head0, rank); break;
    default: merge_splits<W, 8>(p, smem, sbase, t, head0, rank); break;
  }
}

// A quarter record's lines into L2 (the quad's 64-byte pieces and the scales).
__device__ __forceinline__ void prefetch_quarter(const AttnParams& p, EntryRef r, int q) {
  const RecordPtrs rp = record_ptrs(p, r);
  if (rp.data == nullptr) return;
#pragma unroll
  for (int i = 0; i < 9; ++i) prefetch_l2(rp.data + 16 * record_chunk(q, i));
  if (q == 0) prefetch_l2(rp.scales);
}

// Waits until at most n (0..3) of this thread's newest cp.async groups are pending.
__device__ __forceinline__ void cp_async_wait_pending(int n) {
  if (n >= 3) cp_async_wait_group<3>();
  else if (n == 2) cp_async_wait_group<2>();
  else if (n == 1) cp_async_wait_group<1>();
  else cp_async_wait_group<0>();
}

// Whether entry pos of a row (SWA list of ls entries, then the extra list,
// n in all) was written before the step, given ListsReady::records: all but
// each list's last `tokens` entries, where the call's own tokens may have
// written theirs in this step.
__device__ __forceinline__ bool written_before_step(int pos, int ls, int n, int tokens) {
  return pos < ls ? pos < ls - tokens : pos - ls < n - ls - tokens;
}

// One pass of chunks 1 .. chunks-1 into their stages: the entries whose
// `early` flag is `pass_early` (ListsReady::records), one cp.async group a
// chunk whether or not it copies anything, so cp_async_wait_pending's counts
// hold. Sets bit k of `valid` where chunk k's staged records are valid.
template <int W>
__device__ __forceinline__ void stage_pass(const AttnParams& p, const EntryRef* refs, const bool* early, bool pass_early,
                                           int chunks, uint32_t sbase, int e, int q, int tid, uint32_t& valid) {
  using Sh = Shape<W>;
#pragma unroll
  for (int k = 1; k < Sh::kMaxChunks; ++k) {
    if (k >= chunks) break;
    const uint32_t stage = sbase + Sh::stage_off(k);
    if (early[k] == pass_early && stage_quarter(p, refs[k], q, stage + e * 576, stage + Sh::kStageRecords + tid * 8))
      valid |= 1u << k;
    cp_async_commit();
  }
}

// kDiag: the benchmark's instantiation, whose thread 0 stamps the phases
// (kDecode*) into p.debug_clock.
template <int W, bool kDiag>
__global__ void __launch_bounds__(Shape<W>::kThreads) decode_attention_kernel(const __grid_constant__ AttnParams p) {
  using Sh = Shape<W>;
  constexpr int kChunk = Sh::kChunk, kMaxChunks = Sh::kMaxChunks;
  extern __shared__ __align__(16) uint8_t smem[];
  const int cta = int(blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z));
  auto stamp = [&](int k) {
    if constexpr (kDiag)
      if (threadIdx.x == 0) p.debug_clock[cta * kDebugSlots + k] = global_timer_ns();
  };
  stamp(kDecodeEntry);
  const int splits = int(gridDim.x), rank = int(blockIdx.x), t = int(blockIdx.z), head0 = int(blockIdx.y) * kHeads;
  const int tid = int(threadIdx.x), warp = tid >> 5, lane = tid & 31, g = lane >> 2, q4 = lane & 3;
  const int e = tid >> 2, q = tid & 3;  // the gather: entry e of a chunk, record quarter q
  const uint32_t sbase = smem_u32(smem);
  // The row's lengths from the plan, before the wait (the plan kernel lets
  // nothing start before it ends: pdl.cuh); this split's entries [a, b).
  const int4 info = __ldg(p.plan.unit_info + int64_t(t) * p.plan_head_blocks);
  const int ls = info.y, n = info.y + info.z;
  const int a = int(int64_t(n) * rank / splits), b = int(int64_t(n) * (rank + 1) / splits);
  const int chunks = (b - a + kChunk - 1) / kChunk;
  // This thread's entry of every chunk: the indices, then the records into
  // L2, all at once. Before the wait where the list is step metadata; the
  // records themselves may still be written by an earlier kernel (this
  // layer's own token), so they are read after it (an L2 prefetch is safe:
  // L2 is where writes land), but for those an earlier step wrote (early:
  // ListsReady::records), which load here as well.
  EntryRef refs[kMaxChunks];
  bool have[kMaxChunks], early[kMaxChunks];
#pragma unroll
  for (int k = 0; k < kMaxChunks; ++k) {
    const int pos = a + k * kChunk + e;
    have[k] = pos >= b || (pos < ls ? p.swa_ready : p.extra_ready);
    refs[k] = have[k] ? row_entry(p, t, ls, pos, b) : EntryRef{-1, -1};
    early[k] = have[k] && pos < b && p.records_ready && written_before_step(pos, ls, n, p.num_tokens);
  }
#pragma unroll
  for (int k = 0; k < kMaxChunks; ++k)
    if (have[k] && !early[k]) prefetch_quarter(p, refs[k], q);
  // The early records: chunk 0's into registers, the later chunks' into
  // their stages (one cp.async group a chunk, then one a chunk for the rest
  // after the wait, so cp_async_wait_pending's counts below hold).
  Quarter x;
  if (early[0]) load_quarter(p, refs[0], q, x);
  uint32_t staged_valid = 0;
  stage_pass<W>(p, refs, early, true, chunks, sbase, e, q, tid, staged_valid);
  wait_for_prior_grids();
  stamp(kDecodeWaited);
#pragma unroll
  for (int k = 0; k < kMaxChunks; ++k)
    if (!have[k]) refs[k] = row_entry(p, t, ls, a + k * kChunk + e, b);
#pragma unroll
  for (int k = 0; k < kMaxChunks; ++k)
    if (!have[k]) prefetch_quarter(p, refs[k], q);

  for (int i = tid; i < kHeads * 64; i += Sh::kThreads) {  // Q rows; padded heads read as zeros
    const int row = i >> 6, c = i & 63, head = head0 + row;
    const bool valid = head < p.num_heads;
    const uint16_t* src = p.q + (int64_t(t) * p.num_heads + (valid ? head : 0)) * 512 + c * 8;
    cp_async_16(sbase + Sh::kSmQ + row_chunk(row, c), src, valid ? 16 : 0);
  }
  cp_async_commit();
  if (!early[0]) load_quarter(p, refs[0], q, x);
  // The other entries of chunks 1.. into their stages (after Q's group).
  stage_pass<W>(p, refs, early, false, chunks, sbase, e, q, tid, staged_valid);

  float* red = reinterpret_cast<float*>(smem + Sh::kSmRed);
  float acc[Sh::kTiles][4];
#pragma unroll
  for (int j = 0; j < Sh::kTiles; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.0f;
  float m_run[2] = {-INFINITY, -INFINITY}, l_run[2] = {0.0f, 0.0f};
  for (int k = 0; k < chunks; ++k) {
    if (k == 0) {
      store_quarter(smem + Sh::kSmK, row_chunk, e, q, x);
      if (q == 0) smem[Sh::kSmMask + e] = x.valid ? 1 : 0;
      cp_async_wait_pending(chunks - 1);  // Q
    } else {
      __syncthreads();  // every warp's P V of the last chunk is done with K, P and the maxima
      cp_async_wait_pending(chunks - 1 - k);  // this thread's copies of chunk k
      const uint8_t* stage = smem + Sh::stage_off(k);
      store_staged_quarter(smem + Sh::kSmK, row_chunk, e, q, stage + e * 576, stage + Sh::kStageRecords + tid * 8);
      if (q == 0) smem[Sh::kSmMask + e] = (staged_valid >> k) & 1u;
    }
    __syncthreads();
    if (k == 0) stamp(kDecodeStored);

    float s[4];
    scores<W>(sbase, smem, warp, lane, s);
    const int e0 = 8 * warp + 2 * q4;
    const bool v0 = smem[Sh::kSmMask + e0] != 0, v1 = smem[Sh::kSmMask + e0 + 1] != 0;
    s[0] = v0 ? s[0] * p.scale_log2 : -INFINITY;
    s[1] = v1 ? s[1] * p.scale_log2 : -INFINITY;
    s[2] = v0 ? s[2] * p.scale_log2 : -INFINITY;
    s[3] = v1 ? s[3] * p.scale_log2 : -INFINITY;
    const float wm0 = quad_max(fmaxf(s[0], s[1])), wm1 = quad_max(fmaxf(s[2], s[3]));
    if (q4 == 0) {
      red[warp * kHeads + g] = wm0;
      red[warp * kHeads + g + 8] = wm1;
    }
    __syncthreads();
    float mx0 = red[g], mx1 = red[g + 8];
#pragma unroll
    for (int w = 1; w < W; ++w) {
      mx0 = fmaxf(mx0, red[w * kHeads + g]);
      mx1 = fmaxf(mx1, red[w * kHeads + g + 8]);
    }
    const float mn0 = fmaxf(m_run[0], mx0), mn1 = fmaxf(m_run[1], mx1);
    // Rows with nothing attended yet keep max -inf: use 0 as the exponent base.
    const float base0 = mn0 == -INFINITY ? 0.0f : mn0, base1 = mn1 == -INFINITY ? 0.0f : mn1;
    const float alpha0 = fast_exp2(m_run[0] - base0), alpha1 = fast_exp2(m_run[1] - base1);
    m_run[0] = mn0;
    m_run[1] = mn1;
    const float p0 = fast_exp2(s[0] - base0), p1 = fast_exp2(s[1] - base0);
    const float p2 = fast_exp2(s[2] - base1), p3 = fast_exp2(s[3] - base1);
    l_run[0] = l_run[0] * alpha0 + (p0 + p1);
    l_run[1] = l_run[1] * alpha1 + (p2 + p3);
    *reinterpret_cast<uint32_t*>(smem + Sh::kSmP + g * Sh::kPRow + 2 * e0) = pack_bf16(p0, p1);
    *reinterpret_cast<uint32_t*>(smem + Sh::kSmP + (g + 8) * Sh::kPRow + 2 * e0) = pack_bf16(p2, p3);
#pragma unroll
    for (int j = 0; j < Sh::kTiles; ++j) {
      acc[j][0] *= alpha0;
      acc[j][1] *= alpha0;
      acc[j][2] *= alpha1;
      acc[j][3] *= alpha1;
    }
    __syncthreads();  // all of P
    add_pv<W>(sbase, warp, lane, acc);
  }
  cp_async_wait_group<0>();  // a split without entries never waited for Q, which O overwrites
  // Only now may the next kernel (wo_a) start its CTAs: they begin reading
  // their weights before their wait, which slowed this kernel's record
  // loads when it came right after the wait (run AG2).
  launch_dependents();

  // The row sums: over the quad, then over the warps in order.
  const float lq0 = quad_sum(l_run[0]), lq1 = quad_sum(l_run[1]);
  __syncthreads();  // every warp's P V is done: O may overwrite Q and K, the sums the maxima
  if (q4 == 0) {
    red[warp * kHeads + g] = lq0;
    red[warp * kHeads + g + 8] = lq1;
  }
  float* o = reinterpret_cast<float*>(smem + Sh::kSmO);
#pragma unroll
  for (int j = 0; j < Sh::kTiles; ++j) {
    const int d = Sh::kDims * warp + 8 * j + 2 * q4;
    *reinterpret_cast<float2*>(o + g * kORow + d) = make_float2(acc[j][0], acc[j][1]);
    *reinterpret_cast<float2*>(o + (g + 8) * kORow + d) = make_float2(acc[j][2], acc[j][3]);
  }
  __syncthreads();
  stamp(kDecodeLooped);
  if (warp == 0 && q4 == 0) {
    float2* stats = reinterpret_cast<float2*>(smem + Sh::kSmStats);
#pragma unroll
    for (int ri = 0; ri < 2; ++ri) {
      const int r = g + 8 * ri;
      float l = red[r];
#pragma unroll
      for (int w = 1; w < W; ++w) l += red[w * kHeads + r];
      stats[r] = make_float2(m_run[ri], l);
    }
  }
  if (splits > 1) cluster_sync(); else __syncthreads();  // every split's O and {m, l}
  stamp(kDecodeMerging);
  merge<W>(p, smem, sbase, t, head0, rank, splits);
  stamp(kDecodeWritten);
  if (splits > 1) cluster_sync();  // no CTA leaves while another may still read its shared memory
}

template <int W>
int prepare_warps() {
  for (auto k : {decode_attention_kernel<W, false>, decode_attention_kernel<W, true>}) {
    const cudaError_t e = cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                               Shape<W>::smem_bytes(Shape<W>::kMaxChunks));
    if (e != cudaSuccess) return -int(e);
  }
  return 0;
}

template <int W>
void launch_warps(const AttnParams& p, int splits, cudaStream_t stream) {
  using Sh = Shape<W>;
  const unsigned groups = unsigned((p.num_heads + kHeads - 1) / kHeads);
  auto kernel = p.debug_clock != nullptr ? decode_attention_kernel<W, true> : decode_attention_kernel<W, false>;
  // Stages for the longest split's chunks after its first (rows are at most
  // their lists' widths: the plan clamps the lengths).
  const int per_split = (p.swa.width + p.extra.width + splits - 1) / splits;
  const int chunks = std::clamp((per_split + Sh::kChunk - 1) / Sh::kChunk, 1, Sh::kMaxChunks);
  pdl_launch_clustered(kernel, dim3(unsigned(splits), groups, unsigned(p.num_tokens)), dim3(Sh::kThreads),
                       Sh::smem_bytes(chunks), stream, dim3(unsigned(splits)), p);
}

}  // namespace

int decode_attention_prepare() {
  for (int r : {prepare_warps<4>(), prepare_warps<8>(), prepare_warps<16>()})
    if (r < 0) return r;
  return 0;
}

void launch_decode_attention(const AttnParams& p, int splits, int warps, cudaStream_t stream) {
  if (warps == 16) launch_warps<16>(p, splits, stream);
  else if (warps == 8) launch_warps<8>(p, splits, stream);
  else launch_warps<4>(p, splits, stream);
}

}  // namespace dsv4::cuda
