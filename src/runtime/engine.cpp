#include "runtime/engine.h"

#include <algorithm>

#include "attn/cpu/cpu_backend.h"
#include "common/error.h"
#if DSV4_HAVE_CUDA
#include "attn/cuda/cuda_backend.h"
#endif

namespace dsv4 {
namespace {

CacheLimits limits_for(const CacheSpec& spec, const EngineOptions& o) {
  CacheLimits l = CacheLimits::for_workload(spec, o.workload.max_requests, o.workload.max_context,
                                            o.workload.max_step_tokens);
  l.max_bytes = o.cache_bytes;
  return l;
}

std::unique_ptr<AttentionBackend> make_backend(const ModelConfig& c, const std::vector<LayerWeights>& w,
                                               const CacheSpec& spec, const EngineOptions& o) {
  // FP8 blocks need widths the exact profile does not (checked before any op
  // could meet a partial block inside a parallel region).
  if (o.profile == Profile::kProduction) check_production_dims(c);
  const BackendOptions bo{o.profile, o.index_keys, o.cache_weights, o.indexer_key_tile};
  if (o.device == Device::kCpu) return make_cpu_backend(c, w, spec, bo);
#if DSV4_HAVE_CUDA
  const CudaBackendOptions co{o.gpu_memory, o.cache_bytes, o.workload.max_requests, o.workload.max_context,
                              o.workload.max_step_tokens, o.cuda_graphs, o.cuda_lanes, o.cuda_lanes_max_tokens,
                              o.cuda_attention_decode_max_tokens, o.cuda_attention_decode_max_entries,
                              o.cuda_attention_decode_warps, o.cuda_short_select};
  return make_cuda_backend(c, w, spec, bo, co);
#else
  throw Error("this build has no CUDA backend (configure where nvcc is found)");
#endif
}

bool cuda_present() {
#if DSV4_HAVE_CUDA
  return cuda_device_available();
#else
  return false;
#endif
}

}  // namespace

Device parse_device(std::string_view name) {
  if (name == "cpu") return Device::kCpu;
  if (name == "auto") return cuda_present() ? Device::kCuda : Device::kCpu;
  if (name == "cuda") {
#if !DSV4_HAVE_CUDA
    throw Error("--device cuda: this build has no CUDA backend (configure where nvcc is found)");
#endif
    DSV4_REQUIRE(cuda_present(), "--device cuda: no CUDA device is available");
    return Device::kCuda;
  }
  throw Error("unknown device '" + std::string(name) + "' (expected cpu, cuda or auto)");
}

std::string_view device_name(Device d) { return d == Device::kCuda ? "cuda" : "cpu"; }

Engine::Engine(const ModelConfig& config, std::vector<LayerWeights> weights, const EngineOptions& options,
               std::shared_ptr<const Checkpoint> checkpoint)
    : config_(config), options_(options), checkpoint_(std::move(checkpoint)), weights_(std::move(weights)),
      spec_(config_, CacheFormats{options.profile == Profile::kProduction, options.index_keys}),
      backend_(make_backend(config_, weights_, spec_, options)),
      blocks_(spec_, backend_->cache_limits().value_or(limits_for(spec_, options))) {
  DSV4_REQUIRE(int(weights_.size()) == config_.num_layers, "engine: " + std::to_string(weights_.size()) +
                                                          " layers of weights for " +
                                                          std::to_string(config_.num_layers) + " layers");
  for (int l = 0; l < config_.num_layers; ++l)
    DSV4_REQUIRE(weights_[size_t(l)].layer == l && weights_[size_t(l)].type == config_.layer_type(l),
            "engine: the weights given for layer " + std::to_string(l) + " are layer " +
                std::to_string(weights_[size_t(l)].layer) + "'s (" +
                std::string(layer_type_name(weights_[size_t(l)].type)) + ")");
}

Engine::~Engine() = default;

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

StepMetadata Engine::plan(const std::vector<Run>& runs, std::vector<RunError>& errors) {
  StepMetadata s = plan_step(runs, config_, blocks_, errors, backend_->reads_host_step_lists());
  ensure_backend_pages();
  return s;
}

void Engine::ensure_backend_pages() {
  // At least one page per group: ops check their views even before a
  // request has written to an arena.
  for (CacheGroup g : kAllCacheGroups)
    if (blocks_.uses(g)) backend_->ensure_pages(g, std::max(1, blocks_.pool(g).high_water()));
}

void Engine::begin(const StepMetadata& s, std::span<const float> input) {
  const size_t n = size_t(s.num_tokens()) * size_t(config_.hidden_size);
  DSV4_REQUIRE(input.size() == n, "engine: the step's input has " + std::to_string(input.size()) + " values, not " +
                                 std::to_string(n) + " (tokens x hidden size)");
  backend_->plan(s);
  backend_->set_input(input.data());
}

void Engine::forward_step(const StepMetadata& s, std::span<const float> input, std::span<float> output,
                          std::array<double, kNumLayerTypes>* layer_seconds) {
  DSV4_REQUIRE(output.size() == input.size(), "engine: output and input sizes differ");
  begin(s, input);
  if (s.num_tokens() == 0) return;
  const bool timed = layer_seconds != nullptr;
  if (!backend_->replay_step(timed)) {
    backend_->begin_layers(timed);
    for (int l = 0; l < config_.num_layers; ++l) backend_->forward(l, LayerInput::kResidual);
    backend_->end_layers();
  }
  backend_->read_residual(output.data());
  if (!timed) return;
  const std::vector<double> sec = backend_->layer_seconds();
  for (int l = 0; l < config_.num_layers && size_t(l) < sec.size(); ++l)
    (*layer_seconds)[size_t(config_.layer_type(l))] += sec[size_t(l)];
}

void Engine::forward_layers(const StepMetadata& s, std::span<const float> input, bool capture,
                            const LayerVisitor& visit) {
  begin(s, input);
  std::vector<float> y(input.size());
  for (int l = 0; l < config_.num_layers; ++l) {
    LayerCapture cap;
    if (s.num_tokens() > 0) {
      backend_->forward(l, LayerInput::kSame, capture ? &cap : nullptr);
      backend_->read_output(y.data());
    }
    visit(l, y, capture ? &cap : nullptr);
  }
}

void Engine::fast_forward(int64_t id, int64_t length) {
  DSV4_REQUIRE(blocks_.length(id) == 0, "fast_forward: request " + std::to_string(id) + " is not empty");
  DSV4_REQUIRE(length > 0 && length <= config_.max_position_embeddings,
               "fast_forward: length " + std::to_string(length) + " is out of range");
  // What a decode token at position length - 1 touches is what a request of
  // `length` tokens holds once committed.
  blocks_.reserve(id, length - 1, 1);
  blocks_.commit(id, length);
  ensure_backend_pages();
}

void Engine::commit(const StepMetadata& s) {
  for (const Run& run : s.runs) blocks_.commit(run.request, run.start_pos + run.len);
}

}  // namespace dsv4
