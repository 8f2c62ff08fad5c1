#pragma once
// The lightning indexer of SPEC §4.4 on the CPU: per query token, score every
// visible C4A slot by sum_h w_h * ReLU(q_h . K_j) and keep the best
// k = min(index_topk, visible) slots.
#include <cstdint>
#include <vector>

#include "attn/cpu/linear.h"
#include "cache/entries.h"
#include "cache/index_key_format.h"
#include "model/config.h"
#include "numerics/rope.h"
#include "step/step_layout.h"

namespace dsv4 {

class IndexerOp {
 public:
  // Keys are scored in tiles of `key_tile` (memory O(tile + T * k)).
  IndexerOp(const IndexerWeights& w, const ModelConfig& config, Profile profile, bool cache_weights, const Rope& rope,
            IndexKeyFormat key_format, int key_tile = 2048);

  // x: [T, D] layer input; cq: [T, q_lora] normalized query latent. The keys
  // of every visible slot must already be in `keys`. Returns, per token, the
  // request-local slots picked (best first).
  std::vector<std::vector<int32_t>> select(const StepView& s, const float* x, const float* cq,
                                           const EntryArena& keys) const;

 private:
  // Queries [T, nI, 128] as the scorer sees them, and head weights [T, nI].
  void queries(const StepView& s, const float* x, const float* cq, std::vector<float>& q,
               std::vector<float>& w) const;
  // Scores of n consecutive decoded keys for one token.
  void score(const float* q, const float* w, const float* keys, int64_t n, float* scores,
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
