#pragma once
// One V4 attention layer (SPEC §4) on the CPU, run over a whole step in the
// order of SPEC §7: projections; q/kv norms, RoPE and the SWA-cache insert;
// compressor and indexer; sparse attention with the sink; inverse RoPE and
// the grouped output projection.
#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "attn/cpu/compressor.h"
#include "attn/cpu/indexer.h"
#include "attn/cpu/linear.h"
#include "attn/profile.h"
#include "cache/cache_manager.h"
#include "model/config.h"
#include "model/weights.h"
#include "numerics/rope.h"
#include "runtime/step.h"

namespace dsv4 {

// Intermediate tensors a golden replay compares (SPEC §10), all as float.
struct LayerCapture {
  std::vector<float> q;     // [T, H, 512] after RoPE
  std::vector<float> kv;    // [T, 512] as the SWA cache holds it
  std::vector<float> attn;  // [T, H, 512] attention output before inverse RoPE
  std::vector<std::vector<int32_t>> topk;  // [T] request-local C4A picks
  // Entries completed in this step, in token order: [token, 512] and [token, 128].
  std::vector<int> compressed_tokens, index_key_tokens;
  std::vector<float> compressed, index_keys;
};

struct LayerOptions {
  Profile profile = Profile::kProduction;
  IndexKeyFormat index_keys = IndexKeyFormat::kMxfp4;
  bool cache_weights = true;  // float32 copies of the matrices (see Linear)
  int indexer_key_tile = 2048;  // keys scored per tile by the indexer
};

class AttentionLayer {
 public:
  // `weights` and `caches` must outlive the layer.
  AttentionLayer(const ModelConfig& config, const LayerWeights& weights, const LayerCaches& caches,
                 const LayerOptions& options);

  // x, y: [T, D]. Writes this step's entries into the layer's caches.
  void forward(const StepMetadata& s, const float* x, float* y, LayerCapture* capture = nullptr) const;

 private:
  void project_q(const StepMetadata& s, const float* x, std::vector<float>& cq, std::vector<float>& q) const;
  void insert_kv(const StepMetadata& s, const float* x, LayerCapture* capture) const;
  void compress(const StepMetadata& s, const float* x, LayerCapture* capture) const;
  void attend(const StepMetadata& s, const std::vector<float>& q, const std::vector<std::vector<int32_t>>& picks,
              std::vector<float>& o) const;
  void project_out(const StepMetadata& s, std::vector<float>& o, float* y) const;

  const ModelConfig& config_;
  const LayerWeights& w_;
  LayerCaches caches_;
  LayerOptions opt_;
  LayerType type_;
  Rope rope_;
  Linear wq_a_, wq_b_, wkv_, wo_b_;
  std::vector<Linear> wo_a_;  // one per output group
  std::unique_ptr<CompressorOp> compressor_, index_compressor_;
  std::unique_ptr<IndexerOp> indexer_;
};

}  // namespace dsv4
