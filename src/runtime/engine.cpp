#include "runtime/engine.h"

#include "common/error.h"

namespace dsv4 {

Engine::Engine(const ModelConfig& config, std::vector<LayerWeights> weights, const EngineOptions& options,
               std::shared_ptr<const Checkpoint> checkpoint)
    : config_(config), options_(options), checkpoint_(std::move(checkpoint)), weights_(std::move(weights)),
      caches_(config, CacheOptions{options.profile == Profile::kProduction, options.index_keys, options.capacity}) {
  require(int(weights_.size()) == config_.num_layers, "engine: " + std::to_string(weights_.size()) +
                                                          " layers of weights for " +
                                                          std::to_string(config_.num_layers) + " layers");
  for (int l = 0; l < config_.num_layers; ++l)
    require(weights_[size_t(l)].layer == l && weights_[size_t(l)].type == config_.layer_type(l),
            "engine: the weights given for layer " + std::to_string(l) + " are layer " +
                std::to_string(weights_[size_t(l)].layer) + "'s (" +
                std::string(layer_type_name(weights_[size_t(l)].type)) + ")");
  const LayerOptions lopt{options.profile, options.index_keys, options.cache_weights, options.indexer_key_tile};
  for (int l = 0; l < config_.num_layers; ++l)
    layers_.push_back(std::make_unique<AttentionLayer>(config_, weights_[size_t(l)], caches_.layer(l), lopt));
}

std::unique_ptr<Engine> Engine::from_checkpoint(const ModelConfig& config, const std::filesystem::path& path,
                                                const EngineOptions& options) {
  auto ckpt = std::make_shared<const Checkpoint>(Checkpoint::open(path));
  std::vector<LayerWeights> weights;
  for (int l = 0; l < config.num_layers; ++l) weights.push_back(load_layer_weights(*ckpt, config, l));
  return std::make_unique<Engine>(config, std::move(weights), options, ckpt);
}

std::unique_ptr<Engine> Engine::from_seed(const ModelConfig& config, uint64_t seed, const EngineOptions& options) {
  std::vector<LayerWeights> weights;
  for (int l = 0; l < config.num_layers; ++l)
    weights.push_back(random_layer_weights(config, l, seed, config.fp8_weights));
  return std::make_unique<Engine>(config, std::move(weights), options);
}

void Engine::commit(const StepMetadata& s) {
  for (const Run& run : s.runs) caches_.commit(run.request, run.start_pos + run.len);
}

}  // namespace dsv4
