#pragma once
// The attention stack of a model served step by step: the weights, the block
// manager of its paged caches, and one backend (CPU or CUDA) that holds the
// cache bytes and runs the layers. Plan once per step (validate and reserve
// the runs, build the flat metadata), run every layer, then commit.
#include <array>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string_view>
#include <vector>

#include "attn/backend.h"
#include "cache/block_manager.h"
#include "cache/cache_spec.h"
#include "model/config.h"
#include "model/safetensors.h"
#include "model/weights.h"
#include "step/step.h"

namespace dsv4 {

enum class Device { kCpu, kCuda };

// "cpu", "cuda", or "auto" (the GPU when this build has the CUDA backend and
// a device is present); throws Error for anything else, and for "cuda"
// where the build or the machine has none.
Device parse_device(std::string_view name);
std::string_view device_name(Device d);

// The largest workload the caches must address: page ids are sized from it
// (they cost nothing until used; memory follows the pages in use).
struct CacheWorkload {
  int64_t max_requests = 16, max_context = 8192, max_step_tokens = 2048;
};

struct EngineOptions {
  Device device = Device::kCpu;
  // CUDA: device memory for weights, workspaces and caches (a fraction of the
  // free memory when <= 1, else bytes); decode steps in CUDA graphs; a
  // layer's independent chains on their own streams in steps of up to
  // cuda_lanes_max_tokens rows (false: one stream).
  double gpu_memory = 0.9;
  bool cuda_graphs = true;
  bool cuda_lanes = true;
  int64_t cuda_lanes_max_tokens = 128;
  // CUDA: steps of up to this many rows whose rows attend at most
  // cuda_attention_decode_max_entries entries run the sparse attention's
  // decode kernel (0: always its tile kernel; SparseAttentionCudaLimits).
  int cuda_attention_decode_max_tokens = 16;
  int cuda_attention_decode_max_entries = 1024;
  int cuda_attention_decode_warps = 0;  // its CTAs' warps: 4, 8, 16 or 0 (per call)
  bool cuda_short_select = true;        // CudaBackendOptions::short_select
  Profile profile = Profile::kProduction;
  IndexKeyFormat index_keys = IndexKeyFormat::kMxfp4;
  CacheWorkload workload;
  // Limit of the cache pages in use (CUDA: of the device caches, within
  // what gpu_memory leaves for them).
  int64_t cache_bytes = INT64_MAX;
  bool cache_weights = true;
  int indexer_key_tile = 2048;
};

// Called after each layer of Engine::forward_layers with its output [T, D]
// (host floats) and, when requested, its capture.
using LayerVisitor = std::function<void(int layer, std::span<const float> y, const LayerCapture* capture)>;

class Engine {
 public:
  // `checkpoint` (may be null) keeps mapped weight bytes alive.
  Engine(const ModelConfig& config, std::vector<LayerWeights> weights, const EngineOptions& options,
         std::shared_ptr<const Checkpoint> checkpoint = nullptr);
  ~Engine();

  // Weights from a checkpoint file or directory (validated, SPEC §3).
  static std::unique_ptr<Engine> from_checkpoint(const ModelConfig& config, const std::filesystem::path& path,
                                                 const EngineOptions& options);
  // Synthetic weights drawn from a seed.
  static std::unique_ptr<Engine> from_seed(const ModelConfig& config, uint64_t seed, const EngineOptions& options);

  void open_request(int64_t id) { blocks_.open_request(id); }
  void close_request(int64_t id) { blocks_.close_request(id); }

  // Validates the runs, reserves their pages and builds the shared metadata.
  // Rejected runs are reported in `errors` and left out of the step.
  StepMetadata plan(const std::vector<Run>& runs, std::vector<RunError>& errors);
  // The stack on one step: h = input, then for every layer
  // h <- h + attn(RMSNorm(h)); `output` gets the final h. Both [T, D].
  // With `layer_seconds`, the backend times every layer and each time is
  // added to its layer type's entry.
  void forward_step(const StepMetadata& s, std::span<const float> input, std::span<float> output,
                    std::array<double, kNumLayerTypes>* layer_seconds = nullptr);
  // Every layer on the same input (the golden replay's schedule, SPEC §10);
  // `visit` sees each layer's output and, with `capture`, its intermediates.
  void forward_layers(const StepMetadata& s, std::span<const float> input, bool capture, const LayerVisitor& visit);
  // The step's tokens are now part of their requests.
  void commit(const StepMetadata& s);

  // Benchmarks: an open, empty request now holds `length` tokens whose cache
  // entries are whatever its pages hold (fill_caches_synthetic: random valid
  // records), so decode can start at a long context without a prefill.
  void fast_forward(int64_t id, int64_t length);
  void fill_caches_synthetic(uint64_t seed) { backend_->fill_caches_synthetic(seed); }

  const ModelConfig& config() const { return config_; }
  const EngineOptions& options() const { return options_; }
  const BlockManager& blocks() const { return blocks_; }
  const CacheSpec& cache_spec() const { return spec_; }
  AttentionBackend& backend() { return *backend_; }
  int num_layers() const { return config_.num_layers; }

 private:
  void begin(const StepMetadata& s, std::span<const float> input);
  // Storage for every page the block manager has handed out (at least one
  // per group, so every arena exists before a request writes to it).
  void ensure_backend_pages();

  ModelConfig config_;
  EngineOptions options_;
  std::shared_ptr<const Checkpoint> checkpoint_;
  std::vector<LayerWeights> weights_;
  CacheSpec spec_;
  std::unique_ptr<AttentionBackend> backend_;  // before blocks_: it may fix the cache limits
  BlockManager blocks_;
};

}  // namespace dsv4
