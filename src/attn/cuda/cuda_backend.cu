// The CUDA backend (attn/cuda/cuda_backend.h): weights and caches on the
// device, the step's metadata built there, every layer through CudaLayer,
// decode steps padded to a power of two and replayed from CUDA graphs.
#include "attn/cuda/cuda_backend.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <set>
#include <string>

#include "attn/cuda/cuda_buffers.h"
#include "attn/cuda/cuda_layer.h"
#include "attn/cuda/device_cache.h"
#include "attn/cuda/device_step.h"
#include "attn/cuda/indexer_select_cuda.h"
#include "attn/cuda/linear.h"
#include "attn/cuda/residual_norm.h"
#include "attn/cuda/sparse_attention_cuda.h"
#include "common/error.h"
#include "numerics/bf16.h"

namespace dsv4 {
namespace {

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw Error(std::string("cuda backend: ") + what + ": " + cudaGetErrorString(e));
}

int next_pow2(int n) {
  int p = 1;
  while (p < n) p *= 2;
  return p;
}

// The C4A attention plan's lengths: every C4A layer's selection holds
// min(topk, visible) entries, known before any indexer runs.
__global__ void c4a_lengths_kernel(const int32_t* positions, const int32_t* real, int tokens, int topk,
                                   int32_t* lengths) {
  const int t = blockIdx.x * blockDim.x + threadIdx.x;
  if (t >= tokens) return;
  const int visible = t < *real ? (positions[t] + 1) / 4 : 0;
  lengths[t] = visible < topk ? visible : topk;
}

// The largest step the buffers hold: prefill chunks of max_step_tokens, or
// a decode batch of max_requests padded to a power of two.
StepDims step_capacity(const CacheSpec& spec, const CudaBackendOptions& o) {
  StepDims d;
  d.runs = int32_t(std::max<int64_t>(1, o.max_requests));
  d.tokens = int32_t(std::max<int64_t>(o.max_step_tokens, next_pow2(d.runs)));
  const int64_t ctx = std::max<int64_t>(o.max_context, 1);
  for (CacheGroup g : kAllCacheGroups) {
    if (!spec.group(g).used) continue;
    // The widest row: a run of the capacity's tokens ending at the largest context.
    const BlockRange b = spec.blocks_touched(g, std::max<int64_t>(0, ctx - d.tokens), d.tokens);
    d.table_width[int(g)] = int32_t(b.empty() ? 1 : b.last - b.first + 2);
  }
  d.c128a_width = spec.group(CacheGroup::kC128A).used ? int32_t((ctx / 128 + 63) / 64 * 64) : 0;
  return d;
}

class CudaBackend final : public AttentionBackend {
 public:
  CudaBackend(const ModelConfig& config, const std::vector<LayerWeights>& weights, const CacheSpec& spec,
              const BackendOptions& options, const CudaBackendOptions& cuda)
      : config_(config), spec_(spec), cuda_(cuda) {
    DSV4_REQUIRE(options.profile == Profile::kProduction,
                 "the CUDA backend runs production numerics only (use --device cpu for the exact profile)");
    DSV4_REQUIRE(cuda_device_available(), "no CUDA device is available");
    size_t free0 = 0, total = 0;
    check(cudaMemGetInfo(&free0, &total), "cudaMemGetInfo");
    const int64_t budget = cuda.gpu_memory <= 1.0 ? int64_t(cuda.gpu_memory * double(free0)) : int64_t(cuda.gpu_memory);
    DSV4_REQUIRE(budget > 0 && budget <= int64_t(free0),
                 "--gpu-memory asks for " + std::to_string(budget >> 20) + " MiB; the device has " +
                     std::to_string(free0 >> 20) + " MiB free");
    check(cudaStreamCreateWithPriority(&stream_, cudaStreamNonBlocking, lane_priority(cuda::Lane::kMain)),
          "cudaStreamCreate");
    const StepDims cap = step_capacity(spec, cuda);
    for (const LayerWeights& w : weights) layers_.push_back(std::make_unique<cuda::CudaLayer>(config, w, options.index_keys, cuda::LinearOptions{}));
    make_lanes(cap.tokens);
    SparseAttentionCudaLimits attn{cap.tokens, config.num_heads, kNumLayerTypes};
    attn.decode_max_tokens = cuda.attention_decode_max_tokens;
    attn.decode_max_entries = cuda.attention_decode_max_entries;
    attn.decode_warps = cuda.attention_decode_warps;
    attention_ = std::make_unique<SparseAttentionCuda>(attn);
    if (config.count_layers(LayerType::kC4A) > 0)
      indexer_ = std::make_unique<IndexerSelectCuda>(IndexerSelectCudaLimits{cap.tokens, config.index_topk});
    memory_ = std::make_unique<cuda::StepMemory>(config, options.index_keys, cap.tokens);
    step_ = std::make_unique<cuda::DeviceStep>(cap);
    check(cudaMallocHost(&host_io_, size_t(cap.tokens) * size_t(config.hidden_size) * sizeof(float)), "cudaMallocHost");
    // The caches get what the budget leaves, less a reserve for cuBLAS and graphs.
    size_t free1 = 0;
    check(cudaMemGetInfo(&free1, &total), "cudaMemGetInfo");
    const int64_t used = int64_t(free0) - int64_t(free1), reserve = int64_t(512) << 20;
    const int64_t left = budget - used - reserve;
    DSV4_REQUIRE(left > 0, "cuda backend: weights and workspaces take " + std::to_string(used >> 20) + " MiB of a " +
                               std::to_string(budget >> 20) + " MiB budget: nothing is left for the caches (raise "
                               "--gpu-memory or lower --max-running/--budget)");
    const int64_t cache_bytes = std::min(left, cuda.cache_bytes);
    limits_ = CacheLimits::for_memory(spec, cuda.max_requests, cuda.max_context, cuda.max_step_tokens, cache_bytes);
    cache_ = std::make_unique<cuda::DeviceCache>(spec, limits_.pages);
    for (const auto& l : layers_) weight_bytes_ += l->device_bytes();
    workspace_bytes_ = used - weight_bytes_;
    bufs_.stream = stream_;
    bufs_.cache = cache_.get();
    bufs_.attention = attention_.get();
    bufs_.indexer = indexer_.get();
    bufs_.real_tokens = step_->real_tokens();
    bufs_.step = step_->view();
    for (int l = 0; l < config.num_layers; ++l)
      if (first_layer_[int(config.layer_type(l))] < 0) first_layer_[int(config.layer_type(l))] = l;
  }

  ~CudaBackend() override {
    for (auto& [key, g] : graphs_) cudaGraphExecDestroy(g);
    for (cudaEvent_t e : events_) cudaEventDestroy(e);
    for (cudaEvent_t e : indexer_events_) cudaEventDestroy(e);
    for (cudaEvent_t e : lane_events_)
      if (e) cudaEventDestroy(e);
    for (cudaStream_t s : lane_streams_)
      if (s != stream_) cudaStreamDestroy(s);
    cudaFreeHost(host_io_);
    if (stream_) cudaStreamDestroy(stream_);
  }

  std::string_view name() const override { return "cuda"; }
  std::optional<CacheLimits> cache_limits() const override { return limits_; }

  void ensure_pages(CacheGroup g, int32_t pages) override {
    DSV4_REQUIRE(pages <= cache_->pages(g), "cuda backend: the " + std::string(cache_group_name(g)) + " arena holds " +
                                                std::to_string(cache_->pages(g)) + " pages, " +
                                                std::to_string(pages) + " are needed");
  }

  // DeviceStep copies the inputs and derives the lists on the device.
  bool reads_host_step_lists() const override { return false; }

  void plan(const StepMetadata& s) override {
    real_ = s.num_tokens();
    bool decode = real_ > 0;
    for (const Run& r : s.runs) decode = decode && r.len == 1;
    launched_ = decode ? next_pow2(real_) : real_;
    DSV4_REQUIRE(launched_ <= memory_->max_tokens(),
                 "cuda backend: a step of " + std::to_string(real_) + " tokens exceeds the capacity of " +
                     std::to_string(memory_->max_tokens()) + " (the engine's max_step_tokens)");
    // Short decode rows: the indexer in one kernel (IndexerSelectCuda::
    // run_short), a graph of its own (its kernels differ).
    int64_t last = 0;
    for (const Run& r : s.runs) last = std::max(last, r.start_pos + r.len - 1);
    const bool short_select = decode && indexer_ && cuda_.short_select && indexer_short_select_fits(launched_, last);
    graph_key_ = decode && cuda_.graphs ? 2 * launched_ + int(short_select) : 0;
    step_->stage(s);
    memory_->bind(bufs_, launched_);
    bufs_.one_token_per_run = decode;
    bufs_.short_select = short_select;
    bind_lanes();
    prologue_done_ = false;
    residual_ = Residual::kNone;
    capturing_ = false;
    timed_ = false;
  }

  void set_input(const float* x) override {
    const size_t n = size_t(real_) * size_t(config_.hidden_size);
    std::copy_n(x, n, host_io_);  // not memcpy: an empty step passes a null x
    check(cudaMemcpyAsync(bufs_.h, host_io_, n * sizeof(float), cudaMemcpyHostToDevice, stream_), "input copy");
  }

  bool replay_step(bool timed) override {
    timed_ = timed;
    if (graph_key_ == 0) return false;
    const auto it = graphs_.find({graph_key_, timed});
    if (it == graphs_.end()) return false;
    step_->copy(stream_);
    check(cudaGraphLaunch(it->second, stream_), "graph launch");
    return true;
  }

  void begin_layers(bool timed) override {
    timed_ = timed;
    step_->copy(stream_);
    ensure_events();
    // A padded decode batch is captured the second time it runs: the first
    // run is eager (and warms every kernel and cuBLAS plan up).
    if (graph_key_ != 0 && seen_.count({graph_key_, timed})) {
      check(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal), "begin capture");
      capturing_ = true;
    }
    bufs_.indexer_events = timed ? indexer_events_.data() : nullptr;
    bufs_.capturing = capturing_;
    seen_.insert({graph_key_, timed});
    prologue();
  }

  void forward(int layer, LayerInput in, LayerCapture* capture) override {
    DSV4_REQUIRE(layer >= 0 && layer < int(layers_.size()), "cuda backend: no layer " + std::to_string(layer));
    if (!prologue_done_) {  // eager steps that skipped begin_layers (golden replay)
      step_->copy(stream_);
      bufs_.indexer_events = nullptr;
      prologue();
    }
    if (timed_) record(2 * layer);
    if (in != LayerInput::kResidual || residual_ != Residual::kNormed) {  // else the previous layer's wo_b ran it
      cuda::ResidualNormParams r = residual_params(residual_ == Residual::kPendingY);
      if (in != LayerInput::kResidual) {  // the step's input as the layer's input
        r.mode = cuda::ResidualMode::kLoad;
        r.input = bufs_.h, r.input_ld = config_.hidden_size;
      }
      cuda::residual_norm_cuda(r, stream_);
    }
    // kResidual: h += y and the next layer's input norm (what the next
    // forward(kResidual) or end_layers would start with) in wo_b's kernel,
    // where it fuses.
    const cuda::ResidualNormParams next = residual_params(true);
    const bool normed = layers_[size_t(layer)]->forward(bufs_, capture, in == LayerInput::kResidual ? &next : nullptr);
    residual_ = in != LayerInput::kResidual ? Residual::kNone : normed ? Residual::kNormed : Residual::kPendingY;
    if (timed_) record(2 * layer + 1);
  }

  void end_layers() override {
    add_pending_y();
    if (!capturing_) return;
    cudaGraph_t graph = nullptr;
    check(cudaStreamEndCapture(stream_, &graph), "end capture");
    capturing_ = false;
    bufs_.capturing = false;
    cudaGraphExec_t exec = nullptr;
    const cudaError_t e = cudaGraphInstantiate(&exec, graph, cudaGraphInstantiateFlagUseNodePriority);
    cudaGraphDestroy(graph);
    check(e, "graph instantiate");
    graphs_[{graph_key_, timed_}] = exec;
    check(cudaGraphLaunch(exec, stream_), "graph launch");
  }

  void read_residual(float* out) override {
    add_pending_y();
    copy_out(bufs_.h, out);
  }

  void read_output(float* out) override {
    const size_t n = size_t(real_) * size_t(config_.hidden_size);
    std::vector<uint16_t> y(n);
    check(cudaMemcpyAsync(y.data(), bufs_.y, n * 2, cudaMemcpyDeviceToHost, stream_), "output copy");
    synchronize();
    for (size_t i = 0; i < n; ++i) out[i] = bf16_to_float(y[i]);
  }

  void synchronize() override { check(cudaStreamSynchronize(stream_), "step"); }

  double indexer_seconds() override {
    if (!timed_) return 0.0;
    synchronize();
    double sec = 0;
    for (size_t l = 0; l < layers_.size(); ++l) {
      if (layers_[l]->type() != LayerType::kC4A) continue;
      float ms = 0;
      check(cudaEventElapsedTime(&ms, indexer_events_[2 * l], indexer_events_[2 * l + 1]), "indexer timing");
      sec += ms * 1e-3;
    }
    return sec;
  }

  std::vector<double> layer_seconds() override {
    std::vector<double> sec(layers_.size(), 0.0);
    if (!timed_) return sec;
    synchronize();
    for (size_t l = 0; l < layers_.size(); ++l) {
      float ms = 0;
      check(cudaEventElapsedTime(&ms, events_[2 * l], events_[2 * l + 1]), "layer timing");
      sec[l] = ms * 1e-3;
    }
    return sec;
  }

  BackendMemory memory() const override { return BackendMemory{weight_bytes_, cache_->bytes(), workspace_bytes_}; }

  void fill_caches_synthetic(uint64_t seed) override {
    cache_->fill_synthetic(seed, stream_);
    synchronize();
  }

 private:
  // The main workspace serves every linear (steps that run on one stream);
  // each other lane with linears gets a stream and a workspace for the steps
  // that run on lanes (up to lanes_max_tokens rows).
  void make_lanes(int max_m) {
    std::vector<cuda::LinearNeeds> all;
    for (const auto& layer : layers_)
      for (int l = 0; l < cuda::kNumLanes; ++l)
        for (const cuda::LinearNeeds& n : layer->needs(max_m, cuda::Lane(l))) all.push_back(n);
    linear_.push_back(std::make_unique<cuda::LinearWorkspace>(all));
    lane_streams_[0] = stream_;
    lane_linear_[0] = linear_[0].get();
    const int lane_m = int(std::min<int64_t>(max_m, cuda_.lanes_max_tokens));
    for (int l = 1; l < cuda::kNumLanes; ++l) {
      std::vector<cuda::LinearNeeds> needs;
      if (cuda_.lanes && lane_m > 0)
        for (const auto& layer : layers_)
          for (const cuda::LinearNeeds& n : layer->needs(lane_m, cuda::Lane(l))) needs.push_back(n);
      lane_streams_[l] = stream_;
      lane_linear_[l] = linear_[0].get();
      if (needs.empty()) continue;
      linear_.push_back(std::make_unique<cuda::LinearWorkspace>(needs));
      lane_linear_[l] = linear_.back().get();
      check(cudaStreamCreateWithPriority(&lane_streams_[l], cudaStreamNonBlocking, lane_priority(cuda::Lane(l))),
            "cudaStreamCreate");
    }
    if (!cuda_.lanes || lane_m <= 0) return;
    for (cudaEvent_t& e : lane_events_) check(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "cudaEventCreate");
  }

  // Stream priorities: where lanes run side by side, the multiprocessors
  // take the compressor lane's CTAs first (its chain ends in the indexer's
  // keys and the C128A entries, the longest wait of their layers), then the
  // main lane's, then q's heads (C4A: needed only after the indexer).
  // Graphs keep them: captured kernel nodes copy their stream's priority
  // and are instantiated to use it.
  static int lane_priority(cuda::Lane lane) {
    int least = 0, greatest = 0;
    check(cudaDeviceGetStreamPriorityRange(&least, &greatest), "cudaDeviceGetStreamPriorityRange");
    switch (lane) {
      case cuda::Lane::kCompress: return greatest;
      case cuda::Lane::kMain: return greatest < least ? greatest + 1 : greatest;
      case cuda::Lane::kHeads: break;
    }
    return least;
  }

  // The step's lanes: their own streams for steps of up to lanes_max_tokens
  // rows, else all on the main stream (no events: the serial engine).
  void bind_lanes() {
    const bool on = cuda_.lanes && launched_ <= cuda_.lanes_max_tokens;
    for (int l = 0; l < cuda::kNumLanes; ++l) {
      bufs_.lanes[l] = on ? lane_streams_[l] : stream_;
      bufs_.lane_linear[l] = on ? lane_linear_[l] : linear_[0].get();
    }
    for (int p = 0; p < cuda::kNumLanePoints; ++p) bufs_.lane_events[p] = on ? lane_events_[p] : nullptr;
  }

  // Once per step, before its first layer: the metadata built on the device,
  // the C4A lengths, one attention plan per layer type, the indexer's plan.
  void prologue() {
    step_->build(stream_);
    if (indexer_) {
      c4a_lengths_kernel<<<unsigned((launched_ + 127) / 128), 128, 0, stream_>>>(
          bufs_.step.positions, bufs_.real_tokens, launched_, config_.index_topk, bufs_.c4a_lengths);
      check(cudaGetLastError(), "c4a lengths kernel");
    }
    for (int t = 0; t < kNumLayerTypes; ++t) {
      if (first_layer_[t] < 0) continue;
      const cuda::CudaLayer& first = *layers_[size_t(first_layer_[t])];
      // Padded rows get no attention work: their rows of o keep a defined
      // earlier value (zeros, or a past step's output), which the output
      // linears read and nothing uses.
      attention_->plan(first.attention_params(bufs_), stream_, t, bufs_.real_tokens);
      first.output_rope_table(bufs_);
    }
    if (indexer_ && !bufs_.short_select)
      indexer_->plan(layers_[size_t(first_layer_[int(LayerType::kC4A)])]->indexer_params(bufs_), stream_,
                     bufs_.one_token_per_run ? IndexerGrouping::kOneTokenPerRun : IndexerGrouping::kRuns);
    prologue_done_ = true;
  }

  void add_pending_y() {
    if (residual_ != Residual::kPendingY) return;
    cuda::residual_norm_cuda(residual_params(true), stream_);  // its x is not read
    residual_ = Residual::kNone;
  }

  // h += y (when add_y: the previous layer's output), then x = RMSNorm(h)
  // as bf16 (the compressors' input) and FP8 (wq_a+wkv's).
  cuda::ResidualNormParams residual_params(bool add_y) const {
    cuda::ResidualNormParams r;
    r.mode = cuda::ResidualMode::kAddNorm;
    r.num_tokens = launched_;
    r.num_real_tokens = bufs_.real_tokens;
    r.dim = config_.hidden_size;
    r.h = bufs_.h, r.h_ld = config_.hidden_size;
    r.y = add_y ? bufs_.y : nullptr, r.y_ld = config_.hidden_size;
    r.eps = float(config_.rms_norm_eps);
    r.x = bufs_.x, r.x_ld = config_.hidden_size;
    r.x_fp8 = bufs_.x8;
    return r;
  }

  void copy_out(const float* d, float* out) {
    const size_t n = size_t(real_) * size_t(config_.hidden_size);
    check(cudaMemcpyAsync(host_io_, d, n * sizeof(float), cudaMemcpyDeviceToHost, stream_), "output copy");
    synchronize();
    std::copy_n(host_io_, n, out);
  }

  void ensure_events() {
    while (events_.size() < 2 * layers_.size() || indexer_events_.size() < 2 * layers_.size()) {
      cudaEvent_t a = nullptr, b = nullptr;
      check(cudaEventCreate(&a), "cudaEventCreate");
      events_.push_back(a);
      check(cudaEventCreate(&b), "cudaEventCreate");
      indexer_events_.push_back(b);
    }
  }

  void record(size_t i) { cuda::record_event(events_[i], stream_, capturing_); }

  const ModelConfig& config_;
  const CacheSpec& spec_;
  CudaBackendOptions cuda_;
  cudaStream_t stream_ = nullptr;
  std::vector<std::unique_ptr<cuda::CudaLayer>> layers_;
  std::vector<std::unique_ptr<cuda::LinearWorkspace>> linear_;  // [0] main (every linear), then one per lane
  cudaStream_t lane_streams_[cuda::kNumLanes] = {};
  cuda::LinearWorkspace* lane_linear_[cuda::kNumLanes] = {};
  cudaEvent_t lane_events_[cuda::kNumLanePoints] = {};
  std::unique_ptr<SparseAttentionCuda> attention_;
  std::unique_ptr<IndexerSelectCuda> indexer_;
  std::unique_ptr<cuda::StepMemory> memory_;
  std::unique_ptr<cuda::DeviceStep> step_;
  std::unique_ptr<cuda::DeviceCache> cache_;
  CacheLimits limits_;
  cuda::StepBuffers bufs_;
  float* host_io_ = nullptr;  // pinned: the step's input and output rows
  int first_layer_[kNumLayerTypes] = {-1, -1, -1};
  int real_ = 0, launched_ = 0, graph_key_ = 0;
  // The last layer's output y: not yet added into h (kPendingY), or added
  // with x and x8 normed as the next layer's input (kNormed: wo_b's
  // residual tail ran); kNone: no layer's y waits.
  enum class Residual { kNone, kPendingY, kNormed };
  Residual residual_ = Residual::kNone;
  bool prologue_done_ = false, capturing_ = false;
  std::map<std::pair<int, bool>, cudaGraphExec_t> graphs_;
  std::set<std::pair<int, bool>> seen_;
  std::vector<cudaEvent_t> events_, indexer_events_;
  int64_t weight_bytes_ = 0, workspace_bytes_ = 0;
};

}  // namespace

bool cuda_device_available() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

std::unique_ptr<AttentionBackend> make_cuda_backend(const ModelConfig& config, const std::vector<LayerWeights>& weights,
                                                    const CacheSpec& spec, const BackendOptions& options,
                                                    const CudaBackendOptions& cuda) {
  return std::make_unique<CudaBackend>(config, weights, spec, options, cuda);
}

}  // namespace dsv4
