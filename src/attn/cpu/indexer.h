#pragma once
// The lightning indexer of SPEC §4.4 on the CPU: per query token, score every
// visible C4A slot by sum_h w_h * ReLU(q_h . K_j) and keep the best
// k = min(index_topk, visible) slots.
//
// Production numerics are the flat ops of attn/cpu/indexer_twin.h
// (indexer_queries_cpu, indexer_select_cpu), the twins of the CUDA ops in
// attn/cuda/indexer_*_cuda.h: same inputs, same bits. IndexerOp runs them
// (production) or the float32 path (exact profile) behind the layer's
// interface.
#include <cstdint>
#include <vector>

#include "attn/cpu/indexer_twin.h"
#include "attn/cpu/linear.h"
#include "attn/cpu/scratch.h"
#include "attn/indexer_params.h"
#include "cache/index_key_format.h"
#include "cache/entries.h"
#include "model/config.h"
#include "numerics/rope.h"
#include "step/step_layout.h"

namespace dsv4 {

// ---- the layer's op ----------------------------------------------------------------

class IndexerOp {
 public:
  // Keys are scored in tiles of `key_tile` (memory O(tile + T * k)).
  IndexerOp(const IndexerWeights& w, const ModelConfig& config, Profile profile, bool cache_weights, const Rope& rope,
            IndexKeyFormat key_format, int key_tile = 2048);

  // x: [T, D] layer input; cq: [T, q_lora] normalized query latent. The keys
  // of every visible slot must already be in `keys`. Returns, per token, the
  // request-local slots picked (best first).
  // `ws`: the backend's reused buffers (its FP8 product's input).
  std::vector<std::vector<int32_t>> select(const StepView& s, const float* x, const float* cq,
                                           const EntryArena& keys, CpuScratch& ws) const;
  int64_t copy_bytes() const { return wq_b_.copy_bytes() + weights_proj_.copy_bytes(); }

 private:
  std::vector<std::vector<int32_t>> select_production(const StepView& s, const float* x, const float* cq,
                                                      const EntryArena& keys, CpuScratch& ws) const;
  std::vector<std::vector<int32_t>> select_exact(const StepView& s, const float* x, const float* cq,
                                                 const EntryArena& keys) const;
  // Exact profile: float32 queries [T, nI, 128] and head weights [T, nI].
  void queries_exact(const StepView& s, const float* x, const float* cq, std::vector<float>& q,
                     std::vector<float>& w) const;
  // Exact profile: scores of n consecutive decoded keys for one token.
  void score_exact(const float* q, const float* w, const float* keys, int64_t n, float* scores,
                   std::vector<float>& scratch) const;

  const ModelConfig& config_;
  Profile profile_;
  const Rope& rope_;
  IndexKeyFormat key_format_;
  int key_tile_;
  Linear wq_b_, weights_proj_;
};

// Indices of the k best scores, best first; ties go to the lower slot.
std::vector<int32_t> top_k(const float* scores, int64_t n, int k);

}  // namespace dsv4
