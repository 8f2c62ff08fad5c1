#pragma once
// The CPU backend: float32 activations (bf16-valued in production numerics),
// OpenMP + BLAS ops, host cache arenas that grow with the pages in use.
#include <memory>
#include <vector>

#include "attn/backend.h"

namespace dsv4 {

// `weights` and `spec` must outlive the backend.
std::unique_ptr<AttentionBackend> make_cpu_backend(const ModelConfig& config, const std::vector<LayerWeights>& weights,
                                                   const CacheSpec& spec, const BackendOptions& options);

}  // namespace dsv4
