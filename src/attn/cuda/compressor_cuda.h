#pragma once
// The compressor (SPEC §4.3, §5, §6) on the GPU: CompressorParams
// (attn/compressor_params.h) with device pointers (except `rope`, a host
// object whose 32 frequencies are passed by value). Two kernels:
//   1. state rows: every token's [a | g + ape[pos % m]] into the state cache
//      at its row slot, if it has one;
//   2. entries: every token with entry_slot >= 0 pools its slot from its
//      rows (attn/compressor_math.h, the CPU's code: a row of this step from
//      the projection of the token that holds it, found by position in its
//      run, the others from the state cache), finishes it (bf16, RMSNorm,
//      bf16, RoPE at j*m, bf16, optional Hadamard + bf16) and writes the
//      fp8_ds_mla or indexer-key record.
// With kOneTokenPerRun (a decode step) one kernel does both: a token's window
// then holds no row of another token of the step, so its CTA writes its own
// row and pools it at once. With kRuns (any step the engine plans) one kernel
// does both too: no CTA then reads a state row that another writes. The
// caller vouches for the condition (else a window could read a row another
// CTA is writing).
// compress_cpu (attn/cpu/compress_cpu.h) is the CPU twin: same params, same
// bits (see fused_common.cuh for the two rare exceptions). Production
// numerics only (bf16_rounding), no kF32 records.
//
// Launch only (CUDA-graph capturable); bad parameters throw Error before
// anything launches. The kernels are launched with PDL (pdl.cuh) and read
// the step metadata (positions, token_run, the slots, state_table) before
// they wait for the kernel before them: it must not be written by a kernel
// launched with PDL on the same stream (DeviceStep's are plain launches, and
// copies are never programmatic), only the projections and the caches by
// such a kernel.
#include "attn/compressor_params.h"

struct CUstream_st;  // cudaStream_t without the CUDA headers

namespace dsv4::cuda {

enum class CompressorLaunch {
  kAny,             // any step: rows, then entries
  kOneTokenPerRun,  // every run has at most one token in the step: one kernel
  // Every state row the step writes is written by the token of its run at
  // its position, and a run's tokens are consecutive in the step at
  // consecutive positions (tokens that write no row may sit anywhere), so
  // no entry reads a state row that this step writes: one kernel (it
  // measured faster at every size; compressor_cuda.cu has the rule).
  kRuns,
};

void compressor_cuda(const CompressorParams& p, CUstream_st* stream, CompressorLaunch mode = CompressorLaunch::kAny);

// Kernels compressor_cuda launches for p in `mode` (0, 1 or 2).
int compressor_kernels(const CompressorParams& p, CompressorLaunch mode);

// The checks compressor_cuda runs first (check_compressor_params plus the
// GPU's own); throws Error naming the problem.
void check_compressor_cuda_params(const CompressorParams& p);

// Diagnostics (fused_bench --stamps, --span-stamps): while a buffer is set,
// launches of C128A's cluster kernels take their stamped instantiations,
// whose thread 0 of each CTA writes %globaltimer (ns) at the points below to
// stamps[cta * kWideStampCount + point] (cta: blockIdx.x; kWideSplit CTAs a
// token, or a span in a kRuns step). Read at launch, so a graph captured
// meanwhile keeps the pointer it saw. nullptr: off.
inline constexpr int kWideSplit = 8;  // CTAs a token (the portable cluster size)
inline constexpr int kWideStampCount = 9;
inline constexpr const char* kWideStampNames[kWideStampCount] = {
    "entry", "waited", "staged", "maxima", "weights", "cluster waited", "sums sent", "gathered", "done"};
// The kRuns kernel's points: its span's rows written after the wait, then its
// first entry's phases (0 in a cluster whose span completes none).
inline constexpr const char* kSpanWideStampNames[kWideStampCount] = {
    "entry", "waited", "rows", "staged", "weights", "cluster waited", "sums sent", "gathered", "done"};
void set_compressor_wide_stamps(unsigned long long* stamps);
// Diagnostics (fused_bench --comp-span): above 0, kRuns steps take that
// many tokens a CTA (or cluster; capped at c and at 256) on the span
// kernels, at m = 4 too; 0: the launcher's rule; below 0, kRuns launches
// kAny's two kernels. clusters = false: C128A's main entries on the one-CTA
// kernel.
void set_compressor_span_tokens(int tokens, bool clusters = true);
// The tokens a cluster C128A's main compressor takes in a kRuns step of
// `tokens` tokens (the launcher's rule, or set_compressor_span_tokens'), and
// the clusters of that kernel the current device holds at once.
int compressor_c128a_span(int tokens);
int compressor_c128a_resident_clusters();
// Diagnostics (fused_bench --comp-quad-from): under the launcher's rule, m = 4
// kRuns steps of at least `tokens` tokens take the quad kernel (0: every
// one); -1: the rule's own bounds.
void set_compressor_quad_from(int tokens);

}  // namespace dsv4::cuda
