#pragma once
// One V4 attention layer (SPEC §4) on the CPU, run over a whole step in the
// order of SPEC §7: projections; q/kv norms, RoPE and the SWA-cache insert;
// compressor and indexer; sparse attention with the sink (through
// sparse_attention_cpu); inverse RoPE and the grouped output projection.
#include <cstdint>
#include <memory>
#include <vector>

#include "attn/backend.h"
#include "attn/cpu/compressor.h"
#include "attn/cpu/indexer.h"
#include "attn/cpu/linear.h"
#include "attn/cpu/scratch.h"
#include "cache/entries.h"
#include "numerics/rope.h"
#include "step/step_layout.h"

namespace dsv4 {

// The layer's caches for one step (views into the host storage; empty where
// the layer type has no such cache).
struct LayerCaches {
  EntryArena swa, compressed, index_keys, state, index_state;
};

class CpuLayer {
 public:
  // `weights` must outlive the layer.
  CpuLayer(const ModelConfig& config, const LayerWeights& weights, const BackendOptions& options);

  // x, y: [T, D]. Writes this step's entries into the layer's caches; its
  // activations live in `ws`, the backend's buffers shared by every layer.
  void forward(const StepView& s, const LayerCaches& caches, const float* x, float* y, CpuScratch& ws,
               LayerCapture* capture = nullptr) const;
  // Bytes of the float32 weight copies its ops keep (BackendOptions::cache_weights).
  int64_t weight_copy_bytes() const;

 private:
  // ws.cq, ws.q: the normalized q latent [T, q_lora] and the heads [T, H, 512].
  void project_q(const StepView& s, const float* x, CpuScratch& ws) const;
  void insert_kv(const StepView& s, const LayerCaches& c, const float* x, CpuScratch& ws,
                 LayerCapture* capture) const;
  void compress(const StepView& s, const LayerCaches& c, const float* x, CpuScratch& ws,
                LayerCapture* capture) const;
  // The compressed entries each token attends, as global slots [T, width].
  int extra_list(const StepView& s, const std::vector<std::vector<int32_t>>& picks, std::vector<int32_t>& indices,
                 std::vector<int32_t>& lengths) const;
  // ws.q to ws.o [T, H, 512].
  void attend(const StepView& s, const LayerCaches& c, const std::vector<std::vector<int32_t>>& picks,
              CpuScratch& ws) const;
  void project_out(const StepView& s, CpuScratch& ws, float* y) const;

  const ModelConfig& config_;
  const LayerWeights& w_;
  BackendOptions opt_;
  LayerType type_;
  Rope rope_;
  Linear wq_a_, wq_b_, wkv_, wo_b_;
  std::vector<Linear> wo_a_;  // one per output group
  std::unique_ptr<CompressorOp> compressor_, index_compressor_;
  std::unique_ptr<IndexerOp> indexer_;
};

}  // namespace dsv4
