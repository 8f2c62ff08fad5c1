#pragma once
// CUDA op 2 of the lightning indexer (attn/indexer_params.h): scores of every
// visible key on the tensor cores, a running top-k per token, and the picks
// (request-local, best first), their global slots in the main compressed
// cache and the lengths: the IndexList the sparse attention reads
// (indexer_select_index_list). Every pointer of the params is a DEVICE
// pointer; num_heads must be 64.
//
// Numerics: with MXFP4 keys the picks equal indexer_select_cpu's bit for bit
// (same scores, same total order). With FP8 keys the dot products come from
// the tensor cores' fp32 accumulation, which may differ from the CPU's
// exact dot in the last bits, so picks near the k-th place may differ.
//
// run() launches three kernels (plan on the device from the positions,
// score, finalize; run_planned the last two) and nothing else: no allocation, no synchronisation, so a
// decode step can be captured in a CUDA graph; rows of tokens
// t >= *real_tokens read nothing and get -1 rows and length 0. The object
// owns its workspace, sized at construction from the limits (the token count
// and topk, not the context length). Host-side problems throw Error before
// anything launches; launch errors throw too. Calls of one object must be
// ordered on one stream (they share the workspace).
#include <cstddef>

#include "attn/indexer_params.h"
#include "attn/sparse_attention.h"

struct CUstream_st;  // cudaStream_t without the CUDA headers

namespace dsv4 {

// How the plan groups the step's tokens. kRuns: up to 4 consecutive
// positions of a run share their key tiles (prefill). kOneTokenPerRun (a
// decode step): every token alone, scored by a kernel made for one-token
// groups (twice the warps per multiprocessor). Either is correct for any
// step; a run of several tokens is only scored faster with kRuns.
enum class IndexerGrouping { kRuns, kOneTokenPerRun };

// run_short: decode steps of at most kShortSelectMaxTokens tokens, each
// seeing at most kShortSelectMaxKeys keys (16K context), in one kernel of
// kShortSelectCtas CTAs a token (indexer_short.cu).
inline constexpr int kShortSelectMaxTokens = 16;
inline constexpr int64_t kShortSelectMaxKeys = 4096;
inline constexpr int kShortSelectCtas = 8;

// Whether run_short takes a step of `tokens` tokens (one per run) whose
// largest position is max_position.
constexpr bool indexer_short_select_fits(int tokens, int64_t max_position) {
  return tokens >= 1 && tokens <= kShortSelectMaxTokens && indexer_visible(max_position) <= kShortSelectMaxKeys;
}

struct IndexerSelectCudaLimits {
  int max_tokens = 0;              // tokens of one call
  int topk = kIndexerMaxTopk;      // largest topk of a call (sizes the lists)
  int work_units = 0;              // units of work a call is cut into (0: one per multiprocessor); fewer
                                   // make longer units (tests reach the candidate buffers' cuts so)
};

class IndexerSelectCuda {
 public:
  // On the current CUDA device.
  explicit IndexerSelectCuda(const IndexerSelectCudaLimits& limits);
  ~IndexerSelectCuda();
  IndexerSelectCuda(const IndexerSelectCuda&) = delete;
  IndexerSelectCuda& operator=(const IndexerSelectCuda&) = delete;

  void run(const IndexerSelectParams& p, CUstream_st* stream, IndexerGrouping grouping = IndexerGrouping::kRuns);

  // run() on the plan of the last plan() call (score, then finalize): the
  // plan reads only num_tokens, positions, token_run and real_tokens, so one
  // plan per step serves every C4A layer of the step (their queries, keys
  // and outputs differ). p must agree with that call on those four.
  void run_planned(const IndexerSelectParams& p, CUstream_st* stream);

  // The whole selection of a decode step in one kernel, without a plan:
  // for steps that indexer_short_select_fits (the caller knows the
  // positions; a token past kShortSelectMaxKeys gets an empty selection).
  // The same outputs as run(p, stream, IndexerGrouping::kOneTokenPerRun).
  // Uses none of the workspace.
  void run_short(const IndexerSelectParams& p, CUstream_st* stream);

  // The stages of run() one at a time (benchmarks): plan, then score
  // (score_only: without the running top-k, leaving empty lists), then
  // finalize. A stage reads what the previous one left in the workspace;
  // score and run_planned use the grouping of the last plan.
  void plan(const IndexerSelectParams& p, CUstream_st* stream, IndexerGrouping grouping = IndexerGrouping::kRuns);
  void score(const IndexerSelectParams& p, CUstream_st* stream, bool score_only = false);
  void finalize(const IndexerSelectParams& p, CUstream_st* stream);

  const IndexerSelectCudaLimits& limits() const;
  int grid_size() const;           // CTAs of the score kernel (one per SM)
  size_t workspace_bytes() const;  // device memory owned by this object

 private:
  struct Impl;
  Impl* impl_;
};

// The checks run() does before launching; throws Error naming the problem.
void check_indexer_select_cuda_params(const IndexerSelectParams& p, const IndexerSelectCudaLimits& limits);

// The sparse attention's view of the selection: slots with their lengths.
inline IndexList indexer_select_index_list(const IndexerSelectParams& p) {
  return IndexList{p.slots, p.lengths, p.topk};
}

}  // namespace dsv4
