#pragma once
// One V4 attention layer on the GPU (SPEC §4, production numerics of §5), in
// the order of SPEC §7, as a sequence of CUDA ops:
//   1. [wq_a | wkv] FP8 (one GEMM) -> q/kv norms, RoPE on kv, the SWA record;
//      wq_b FP8 -> per-head norm and RoPE on q (in wq_b's kernel for decode
//      rows); the bf16 projections of the compressors and weights_proj (one
//      GEMM, fp32 out)
//   3. compressors (state rows, entries at block ends; C4A: the index keys
//      first); C4A: indexer q (indexer.wq_b FP8, RoPE, Hadamard,
//      quantization) and its selection
//   4. sparse attention over the window and the compressed entries, the
//      output's inverse RoPE applied as it is written
//   5. wo_a (grouped, FP8 output fused), wo_b FP8 (at decode rows with the
//      residual add and the next layer's input norm in its kernel).
// Weights are uploaded once at construction; the step's activations live in
// the backend's buffers (LayerBuffers).
#include <cstdint>
#include <memory>
#include <optional>

#include "attn/backend.h"
#include "attn/cuda/cuda_buffers.h"
#include "attn/cuda/linear.h"
#include "attn/sparse_attention.h"
#include "model/config.h"
#include "model/weights.h"
#include "numerics/rope.h"

namespace dsv4::cuda {

// A float vector on the device (norm weights, sinks, ape).
class DeviceFloats {
 public:
  DeviceFloats() = default;
  explicit DeviceFloats(const std::vector<float>& host);
  ~DeviceFloats();
  DeviceFloats(DeviceFloats&& o) noexcept : p_(o.p_), n_(o.n_) { o.p_ = nullptr, o.n_ = 0; }
  DeviceFloats& operator=(DeviceFloats&&) = delete;
  DeviceFloats(const DeviceFloats&) = delete;
  const float* get() const { return p_; }
  size_t size() const { return n_; }

 private:
  float* p_ = nullptr;
  size_t n_ = 0;
};

class CudaLayer {
 public:
  CudaLayer(const ModelConfig& config, const LayerWeights& w, IndexKeyFormat keys, const LinearOptions& linear);

  // The layer on the step in `b` (its x and x8 are the input; y the output).
  // `capture` (golden replay): the stream is synchronised where a tensor
  // must be read before a later op overwrites it. `then` (optional): the
  // residual add and norm that follow the layer (kAddNorm on y), run in
  // wo_b's kernel where it can (Fp8Linear::fuses); returns whether it ran.
  bool forward(StepBuffers& b, LayerCapture* capture, const ResidualNormParams* then = nullptr);

  // The sparse attention's call for this layer on the step in `b` (the
  // step's plan for a layer type is built from any layer of the type).
  SparseAttentionParams attention_params(const StepBuffers& b) const;
  // The indexer's call for this (C4A) layer; its plan serves every C4A layer
  // of the step (IndexerSelectCuda::run_planned).
  IndexerSelectParams indexer_params(const StepBuffers& b) const;
  // Once per step and layer type: the output rotation's factors at the
  // step's positions (StepBuffers::out_rope_cs), which attend() fuses into
  // the attention's output writes.
  void output_rope_table(const StepBuffers& b) const;

  // What the layer's linears on `lane` need of its workspace at max_m rows.
  std::vector<LinearNeeds> needs(int max_m, Lane lane) const;
  int64_t device_bytes() const;
  LayerType type() const { return type_; }

 private:
  void project_q_kv(StepBuffers& b);
  void compress(StepBuffers& b);
  void select(StepBuffers& b);
  void attend(StepBuffers& b, bool rotate_out);  // rotate_out: the output inverse RoPE fused in
  // rotate_out: the inverse RoPE first; then: as forward's
  bool project_out(StepBuffers& b, bool rotate_out, const ResidualNormParams* then);
  void mark(StepBuffers& b, int event) const;
  void read_back(const StepBuffers& b, LayerCapture& capture) const;  // golden replay: synchronises the stream
  Lane heads_lane() const;  // wq_b's lane: its own where the indexer runs beside it

  const ModelConfig& config_;
  int layer_;
  LayerType type_;
  IndexKeyFormat keys_;
  Rope rope_;
  Fp8Linear wqkv_, wq_b_, wo_b_;
  // wo_a: one grouped linear, or (o_lora_rank not a multiple of 128) one per
  // group on its rows, with the FP8 quantization of u after them.
  std::vector<W8A16GroupedLinear> wo_a_;
  std::optional<Bf16Linear> proj_;   // compressor (+ indexer compressor, weights_proj) projections
  std::optional<Fp8Linear> idx_wq_b_;
  DeviceFloats q_norm_, kv_norm_, sink_, ape_, norm_, idx_ape_, idx_norm_;
};

}  // namespace dsv4::cuda
