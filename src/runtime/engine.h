#pragma once
// The attention stack of a model: its layers, their caches and the request
// book-keeping, driven one step at a time. Plan once per step (metadata for
// every layer type), run many layers, then commit.
#include <cstdint>
#include <memory>
#include <vector>

#include "attn/layer.h"
#include "cache/cache_manager.h"
#include "model/config.h"
#include "model/safetensors.h"
#include "model/weights.h"
#include "runtime/step.h"

namespace dsv4 {

struct EngineOptions {
  Profile profile = Profile::kProduction;
  IndexKeyFormat index_keys = IndexKeyFormat::kMxfp4;
  CacheCapacity capacity = CacheCapacity::for_workload(16, 8192, 2048);
  bool cache_weights = true;
  int indexer_key_tile = 2048;
};

class Engine {
 public:
  // `checkpoint` (may be null) keeps mapped weight bytes alive.
  Engine(const ModelConfig& config, std::vector<LayerWeights> weights, const EngineOptions& options,
         std::shared_ptr<const Checkpoint> checkpoint = nullptr);

  // Weights from a checkpoint file or directory (validated, SPEC §3).
  static std::unique_ptr<Engine> from_checkpoint(const ModelConfig& config, const std::filesystem::path& path,
                                                 const EngineOptions& options);
  // Synthetic weights drawn from a seed.
  static std::unique_ptr<Engine> from_seed(const ModelConfig& config, uint64_t seed, const EngineOptions& options);

  void open_request(int64_t id) { caches_.open_request(id); }
  void close_request(int64_t id) { caches_.close_request(id); }

  // Validates the runs, reserves their pages and builds the shared metadata.
  // Rejected runs are reported in `errors` and left out of the step.
  StepMetadata plan(const std::vector<Run>& runs, std::vector<RunError>& errors) {
    return plan_step(runs, config_, caches_, errors);
  }
  // x, y: [T, D] for the step's tokens.
  void forward_layer(int layer, const StepMetadata& s, const float* x, float* y,
                     LayerCapture* capture = nullptr) const {
    layers_.at(size_t(layer))->forward(s, x, y, capture);
  }
  // The step's tokens are now part of their requests.
  void commit(const StepMetadata& s);

  const ModelConfig& config() const { return config_; }
  const EngineOptions& options() const { return options_; }
  const CacheManager& caches() const { return caches_; }
  int num_layers() const { return config_.num_layers; }

 private:
  ModelConfig config_;
  EngineOptions options_;
  std::shared_ptr<const Checkpoint> checkpoint_;
  std::vector<LayerWeights> weights_;
  CacheManager caches_;
  std::vector<std::unique_ptr<AttentionLayer>> layers_;
};

}  // namespace dsv4
