#include "attn/cpu/cpu_backend.h"

#include <algorithm>
#include <chrono>

#include "attn/cpu/cpu_layer.h"
#include "cache/host_storage.h"
#include "common/error.h"
#include "numerics/bf16.h"
#include "numerics/rmsnorm.h"

namespace dsv4 {
namespace {

class CpuBackend final : public AttentionBackend {
 public:
  CpuBackend(const ModelConfig& config, const std::vector<LayerWeights>& weights, const CacheSpec& spec,
             const BackendOptions& options)
      : config_(config), spec_(spec), opt_(options), storage_(spec) {
    for (const LayerWeights& w : weights) layers_.push_back(std::make_unique<CpuLayer>(config_, w, options));
    for (const LayerWeights& w : weights) weight_bytes_ += stored_bytes(w);
    for (const auto& l : layers_) copy_bytes_ += l->weight_copy_bytes();
  }

  std::string_view name() const override { return "cpu"; }
  void ensure_pages(CacheGroup g, int32_t pages) override { storage_.ensure_pages(g, pages); }

  void plan(const StepMetadata& s) override {
    step_ = &s;
    const size_t n = size_t(s.num_tokens()) * size_t(config_.hidden_size);
    h_.assign(n, 0.0f);
    x_.assign(n, 0.0f);
    y_.assign(n, 0.0f);
  }

  // copy_n, not memcpy: an empty step passes null pointers with no elements.
  void set_input(const float* x) override { std::copy_n(x, h_.size(), h_.data()); }

  void begin_layers(bool timed) override {
    timed_ = timed;
    seconds_.assign(layers_.size(), 0.0);
  }

  std::vector<double> layer_seconds() override { return seconds_; }

  void forward(int layer, LayerInput in, LayerCapture* capture) override {
    DSV4_REQUIRE(step_ != nullptr, "cpu backend: forward() before plan()");
    const auto t0 = std::chrono::steady_clock::now();
    DSV4_REQUIRE(layer >= 0 && layer < int(layers_.size()), "cpu backend: no layer " + std::to_string(layer));
    const int D = config_.hidden_size, T = step_->num_tokens();
    const bool prod = opt_.profile == Profile::kProduction;
    if (in == LayerInput::kResidual) {
#pragma omp parallel for
      for (int t = 0; t < T; ++t) {
        rms_norm(h_.data() + size_t(t) * D, nullptr, D, float(config_.rms_norm_eps), x_.data() + size_t(t) * D);
        if (prod) round_bf16(x_.data() + size_t(t) * D, size_t(D));
      }
    } else {
      // The step's input as the layer's input: bf16 activations in production
      // (as the GPU loads it), as given in the exact profile.
      x_ = h_;
      if (prod) round_bf16(x_.data(), x_.size());
    }
    layers_[size_t(layer)]->forward(step_->view(), caches(layer), x_.data(), y_.data(), scratch_, capture);
    if (in == LayerInput::kResidual)
      for (size_t i = 0; i < h_.size(); ++i) h_[i] += y_[i];
    if (timed_ && size_t(layer) < seconds_.size())
      seconds_[size_t(layer)] = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }

  void fill_caches_synthetic(uint64_t seed) override { storage_.fill_synthetic(seed); }

  void read_residual(float* out) override { std::copy_n(h_.data(), h_.size(), out); }
  void read_output(float* out) override { std::copy_n(y_.data(), y_.size(), out); }

  BackendMemory memory() const override {
    return BackendMemory{weight_bytes_, storage_.bytes_allocated(),
                         int64_t((h_.size() + x_.size() + y_.size()) * sizeof(float)) + scratch_.bytes(), copy_bytes_};
  }

 private:
  LayerCaches caches(int layer) {
    LayerCaches c;
    auto arena = [&](CacheKind k) {
      const int i = spec_.arena_index(layer, k);
      if (i < 0) return EntryArena{};
      const ArenaSpec& a = spec_.arenas()[size_t(i)];
      return EntryArena{storage_.pages(layer, k), a.format, a.dim};
    };
    c.swa = arena(CacheKind::kSwa);
    c.compressed = arena(CacheKind::kCompressed);
    c.index_keys = arena(CacheKind::kIndexKeys);
    c.state = arena(CacheKind::kState);
    c.index_state = arena(CacheKind::kIndexState);
    return c;
  }

  const ModelConfig& config_;
  const CacheSpec& spec_;
  BackendOptions opt_;
  HostCacheStorage storage_;
  std::vector<std::unique_ptr<CpuLayer>> layers_;
  const StepMetadata* step_ = nullptr;
  std::vector<float> h_, x_, y_;
  CpuScratch scratch_;  // every layer's activations, reused (attn/cpu/scratch.h)
  std::vector<double> seconds_;
  int64_t weight_bytes_ = 0, copy_bytes_ = 0;
};

}  // namespace

std::unique_ptr<AttentionBackend> make_cpu_backend(const ModelConfig& config, const std::vector<LayerWeights>& weights,
                                                   const CacheSpec& spec, const BackendOptions& options) {
  return std::make_unique<CpuBackend>(config, weights, spec, options);
}

}  // namespace dsv4
