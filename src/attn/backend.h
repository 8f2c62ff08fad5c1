#pragma once
// One interface for the attention stack on any device (FlashInfer's plan/run
// split; llama.cpp's backend tables): plan once per step, then run many
// layers. A backend owns its copy of the weights, the bytes of the paged
// caches (under the page ids of the engine's block manager) and the
// activations of a step; the engine (runtime/engine.h) drives it.
#include <cstdint>
#include <memory>
#include <optional>
#include <string_view>
#include <vector>

#include "attn/profile.h"
#include "cache/block_manager.h"
#include "cache/cache_spec.h"
#include "model/config.h"
#include "model/weights.h"
#include "step/step.h"

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

// What a layer reads: the residual stream through the between-layer norm
// (h <- h + attn(RMSNorm(h)), the stack's loop), or the step's input as given
// (the golden replay feeds every layer the same input).
enum class LayerInput { kResidual, kSame };

struct BackendOptions {
  Profile profile = Profile::kProduction;
  IndexKeyFormat index_keys = IndexKeyFormat::kMxfp4;
  bool cache_weights = true;    // CPU: float32 copies of the matrices
  int indexer_key_tile = 2048;  // CPU: keys the indexer scores per tile
};

// Device memory a backend holds, in bytes (host memory for the CPU backend).
struct BackendMemory {
  int64_t weights = 0, caches = 0, workspace = 0;
  int64_t weight_copies = 0;  // the CPU backend's float32 copies of its weights (BackendOptions::cache_weights)
};

class AttentionBackend {
 public:
  virtual ~AttentionBackend() = default;
  virtual std::string_view name() const = 0;

  // A backend whose cache storage is fixed (device arenas allocated once)
  // says how many pages it holds; the engine's block manager then hands out
  // no more. Host storage grows with use: no fixed limits.
  virtual std::optional<CacheLimits> cache_limits() const { return std::nullopt; }
  // Storage for page ids [0, pages) of a group: host arenas grow here; a
  // device backend with fixed arenas checks that they are large enough.
  virtual void ensure_pages(CacheGroup g, int32_t pages) = 0;
  // Once per step, before its layers: the step's metadata, shared by every
  // layer of a type.
  virtual void plan(const StepMetadata& s) = 0;
  // Whether plan() reads the step's derived lists (slots, window and C128A
  // lists) from the host. A backend that derives them from the inputs itself
  // (the CUDA backend, on the device) says no, and the engine skips them.
  virtual bool reads_host_step_lists() const { return true; }
  // The step's input rows, [T, D] host floats: the residual stream h.
  virtual void set_input(const float* x) = 0;
  // The stack's loop over the layers (Engine::forward_step) is bracketed by
  // begin_layers/end_layers, so a backend can capture it (a CUDA graph per
  // padded decode batch); replay_step() first offers to run the whole loop
  // from such a capture, and true means it did (no forward() calls follow).
  // `timed`: measure every layer (layer_seconds).
  virtual bool replay_step(bool timed) { (void)timed; return false; }
  virtual void begin_layers(bool timed) { timed_ = timed; }
  virtual void end_layers() {}
  // One layer on the step's tokens; writes its cache entries. kResidual:
  // y = attn(RMSNorm(h)) and h += y; kSame: y = attn(h) and h unchanged.
  virtual void forward(int layer, LayerInput in, LayerCapture* capture = nullptr) = 0;
  // [T, D] host floats: the residual stream h, or the last layer's output y.
  virtual void read_residual(float* out) = 0;
  virtual void read_output(float* out) = 0;
  // Waits until the work issued so far is done (asynchronous devices).
  virtual void synchronize() {}
  // Seconds of each layer of the last timed step (after its output was read),
  // and of its indexer selections (C4A layers), summed.
  virtual std::vector<double> layer_seconds() = 0;
  virtual double indexer_seconds() { return 0.0; }
  virtual BackendMemory memory() const = 0;
  // Benchmarks: every page of every cache arena becomes random valid records
  // (cache/synthetic_fill.h), so decode can be timed at a long context
  // without prefilling it.
  virtual void fill_caches_synthetic(uint64_t seed) = 0;

 protected:
  bool timed_ = false;
};

}  // namespace dsv4
