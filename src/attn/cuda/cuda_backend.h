#pragma once
// The CUDA backend of the attention stack (sm_90a): FP8 weights uploaded
// once, every cache in device arenas in the byte formats of SPEC §6, per-step
// metadata built on the device from one small copy, all layers through the
// CUDA ops (attn/cuda/), decode steps captured in CUDA graphs per padded batch
// size and replayed. Production numerics only.
#include <cstdint>
#include <memory>
#include <vector>

#include "attn/backend.h"

namespace dsv4 {

struct CudaBackendOptions {
  // Device memory the engine may use: a fraction (<= 1) of what is free when
  // the backend starts, or a number of bytes (> 1). Weights and workspaces
  // come first; the caches get the rest.
  double gpu_memory = 0.9;
  // At most this many bytes of that for the caches (the device arenas are
  // sized to the smaller of this and what the budget leaves).
  int64_t cache_bytes = INT64_MAX;
  // The largest workload (sizes the step buffers and the caches' page ids).
  int64_t max_requests = 16, max_context = 8192, max_step_tokens = 2048;
  bool graphs = true;  // capture decode-only steps in CUDA graphs
  // Run a layer's independent chains on their own streams (cuda_buffers.h:
  // Lane) in steps of up to lanes_max_tokens rows (latency-bound: decode);
  // larger steps, and every step when false, run every kernel on one stream.
  // Same results, bit for bit.
  bool lanes = true;
  int64_t lanes_max_tokens = 128;
  // Steps of up to this many rows run the sparse attention on its decode
  // kernel where the rows have at most attention_decode_max_entries entries
  // (SparseAttentionCudaLimits::decode_max_tokens, decode_max_entries; 0: never).
  int attention_decode_max_tokens = 16;
  int attention_decode_max_entries = 1024;
  int attention_decode_warps = 0;  // SparseAttentionCudaLimits::decode_warps
  // Decode steps of short rows select their C4A keys in one kernel
  // (IndexerSelectCuda::run_short) instead of plan, score and finalize.
  bool short_select = true;
};

// True when a CUDA device is present and usable.
bool cuda_device_available();

// `weights` and `spec` must outlive the backend. Throws Error when the
// device cannot hold the weights, workspaces and the workload's bounded cache
// part.
std::unique_ptr<AttentionBackend> make_cuda_backend(const ModelConfig& config, const std::vector<LayerWeights>& weights,
                                                    const CacheSpec& spec, const BackendOptions& options,
                                                    const CudaBackendOptions& cuda);

}  // namespace dsv4
