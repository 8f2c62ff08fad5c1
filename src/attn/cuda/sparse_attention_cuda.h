#pragma once
// The CUDA backend of the sparse-attention interface (attn/sparse_attention.h)
// for Hopper (sm_90a): same semantics and numerics as sparse_attention_cpu,
// with every pointer of SparseAttentionParams a DEVICE pointer.
//
// Two calls per layer type and step:
//   plan(p, stream, slot)  one tiny kernel: splits the step's work (all tokens
//                          x head blocks x tiles of 64 entries) evenly over the
//                          GPU's multiprocessors, reading the lengths on the
//                          device. Shared by every layer of that type.
//   run(p, stream, slot)   two kernels per layer: attention, then the combine
//                          of rows that were split across multiprocessors
//                          (launched to overlap the attention kernel's tail);
//                          or, for a few tokens with short rows (decode), one
//                          kernel that merges its splits in clusters.
// Both only launch kernels (no allocation, no synchronisation), so a decode
// step can be captured in a CUDA graph. The object owns all device memory,
// sized at construction from the limits.
//
// A plan is valid for the token count, head count, index-list widths and
// lengths it was built from; run() takes the lengths from the plan (the
// indices, q, caches and outputs from its own params). Host-side problems
// (bad params, a run without a matching plan, sizes beyond the limits) throw
// Error before anything is launched; CUDA errors are checked after every call
// and also throw Error. Calls of one object must be ordered on one stream
// (they share the partials' workspace).
#include <cstddef>
#include <cstdint>

#include "attn/sparse_attention.h"

struct CUstream_st;  // cudaStream_t without the CUDA headers

namespace dsv4 {

// The layer's output rotation (SPEC §4.7; cuda/out_rope.h's op, the same
// bits) fused into run(): dims 448..511 of every output head rotated by
// -position, so that the output path launches no kernel of its own. The
// factors come from a table made once per step (out_rope_table_cuda), not
// from a sine per output. The lse is not affected.
struct OutputRope {
  const float* cos_sin = nullptr;  // device, [num_tokens][32][2]: (cos, -sin) per pair; null: no rotation
};

// Which index lists of a call were complete before the step's plan kernel
// (sparse_mla_plan.cu, which lets no later kernel start before it ends):
// the step's metadata, built before its first layer. The decode kernel
// reads their indices before its programmatic-dependent-launch wait.
// records: besides, every record the ready lists point to was written
// before the step, but those of the call's own tokens, which are among each
// list's last num_tokens entries (lists of positions in increasing order,
// as the step builds them: the window ends at the token, C128A's list at
// the entry it may complete); the decode kernel loads the others before its
// wait too, and only those last entries after it.
struct ListsReady {
  bool swa = false;
  bool extra = false;
  bool records = false;
};

struct SparseAttentionCudaLimits {
  int max_tokens = 0;  // tokens of one call
  int max_heads = 128;
  int num_plans = 1;   // plans kept side by side, e.g. one per layer type
  // Pairs of head blocks (H = 128) on separate CTAs instead of clusters of
  // two (tests and comparisons keep that path exercised).
  bool pairs_on_single_ctas = false;
  // Calls of at most decode_max_tokens tokens whose rows (SWA plus extra
  // width) have at most decode_max_entries entries, and at most
  // decode_max_work entries over all tokens, run the decode kernel
  // (sparse_mla_decode.cu) instead of the tile kernel and its combine;
  // decode_max_tokens 0 never does (tests and comparisons). Rows of up to
  // 1,024 entries (kDecodeMaxEntries) are cut into at most 8 splits. The
  // widths are the lists' (the engine sizes C128A's from its largest
  // context), not the rows' lengths. The defaults take one or two tokens
  // with rows of up to 1,024 entries (C4A's 640 at any context) and up to
  // 8 tokens with rows of up to 256 (the window, C128A at short context):
  // where the kernel measured faster (docs/perf-notes.md, runs AH1-AH3).
  int decode_max_tokens = 16;
  int decode_max_entries = 1024;
  int64_t decode_max_work = 2048;
  // The decode kernel's CTAs: 4, 8 or 16 warps, which run chunks of 32, 64
  // or 128 entries (the splits then take up to 4, 2 or 1 chunks); 0:
  // decode_warps() picks per call.
  int decode_warps = 0;
};

class SparseAttentionCuda {
 public:
  // On the current CUDA device.
  explicit SparseAttentionCuda(const SparseAttentionCudaLimits& limits);
  ~SparseAttentionCuda();
  SparseAttentionCuda(const SparseAttentionCuda&) = delete;
  SparseAttentionCuda& operator=(const SparseAttentionCuda&) = delete;

  // real_tokens (optional, a DEVICE int, read by the plan kernel): tokens
  // at and past *real_tokens are padding (a decode step padded to its
  // graph's size). On the tile kernel they get no work, and their rows of
  // out and lse are left as they were. Planned as empty rows, their units
  // (one tile each, with its query load and output writes) went 6-7 to each
  // of the last CTAs by the plan's rule: 96 requests in a step of 128 took
  // 5% longer a step than without them (docs/perf-notes.md, BH6-BH8). The
  // decode kernel (calls of few tokens) writes every row anyway.
  void plan(const SparseAttentionParams& p, CUstream_st* stream, int slot = 0, const int32_t* real_tokens = nullptr);
  void run(const SparseAttentionParams& p, CUstream_st* stream, int slot = 0, const OutputRope& out_rope = {},
           ListsReady ready = {});

  // Diagnostics (benchmark only): run() then uses the kernel instantiation
  // that times every wait into `clock` (kDebugSlots zeroed entries per CTA,
  // sparse_mla_internal.cuh: grid_size() CTAs for the tile kernel, splits x
  // ceil(heads / 16) x tokens for the decode kernel, which writes the
  // kDecode* stamps); null turns it off.
  void set_debug_clock(unsigned long long* clock);

  // The decode kernel's splits of a row for this call, or 0 where run()
  // takes the tile kernel; and the warps of its CTAs.
  int decode_splits(const SparseAttentionParams& p) const;
  int decode_warps(const SparseAttentionParams& p) const;

  const SparseAttentionCudaLimits& limits() const;
  int grid_size() const;           // CTAs of the attention kernel (one per SM)
  size_t workspace_bytes() const;  // device memory owned by this object

 private:
  struct Impl;
  Impl* impl_;
};

// The checks run() and plan() do before launching; throws Error naming the problem.
void check_sparse_attention_cuda_params(const SparseAttentionParams& p, const SparseAttentionCudaLimits& limits);

}  // namespace dsv4
