#pragma once
// The device memory of a step on the CUDA backend: activations sized for the
// largest step at construction (one allocation), and the shared objects
// every layer uses. StepBuffers is what a layer's ops read and write; its
// pointers never move, so a step's launches can be captured in a graph.
#include <cstdint>
#include <memory>

#include "attn/backend.h"
#include "attn/cuda/fp8_act.h"
#include "attn/indexer_params.h"
#include "step/step_layout.h"

struct CUstream_st;
struct CUevent_st;
typedef CUevent_st* cudaEvent_t;

namespace dsv4 {
class SparseAttentionCuda;
class IndexerSelectCuda;
}  // namespace dsv4

namespace dsv4::cuda {

// The GPU indexer scorer's query heads: a model with fewer (nI < 64) runs on
// zero-padded heads (IndexerQueryParams::scale_heads).
inline constexpr int kScorerHeads = 64;

class DeviceCache;
class LinearWorkspace;

// The streams a layer's independent chains run on (cuda_layer.cu): the main
// chain (q and kv, the indexer, attention, output), q's heads (wq_b and its
// norm and RoPE) and the compressors (their projection and pooling). At
// batch 1 every kernel is latency-bound, so chains that do not wait for each
// other overlap. Each lane has its own linear workspace (the split-K
// counters and partial sums of concurrent linears must differ). A serial
// engine gives every lane the main stream and workspace.
enum class Lane { kMain, kHeads, kCompress };
inline constexpr int kNumLanes = 3;
// The points where one lane waits for another, each with its own event.
enum class LanePoint { kLayerInput, kCq, kProj, kIndexKeys, kCompressed, kHeads };
inline constexpr int kNumLanePoints = 6;

struct StepBuffers {
  CUstream_st* stream = nullptr;                    // the main lane (lanes[kMain])
  CUstream_st* lanes[kNumLanes] = {};               // all the main stream in a serial engine
  LinearWorkspace* lane_linear[kNumLanes] = {};     // all the main workspace in a serial engine
  cudaEvent_t lane_events[kNumLanePoints] = {};     // null in a serial engine
  CUstream_st* on(Lane l) const { return lanes[int(l)]; }
  LinearWorkspace& linear(Lane l) const { return *lane_linear[int(l)]; }
  int tokens = 0;                        // rows launched (a padded decode step: the graph's batch size)
  const int32_t* real_tokens = nullptr;  // device: rows at and past it are padding
  bool one_token_per_run = false;        // a decode step: no run has two tokens in it
  bool short_select = false;             // a decode step the indexer selects in one kernel (run_short)
  StepView step{};                       // device arrays, capacity layout
  DeviceCache* cache = nullptr;
  SparseAttentionCuda* attention = nullptr;
  IndexerSelectCuda* indexer = nullptr;

  float* h = nullptr;              // [T, D] fp32 residual stream (also the golden input)
  uint16_t* x = nullptr;           // [T, D] bf16 layer input
  Fp8ActOut x8;                    // its FP8 form
  uint16_t* qkv = nullptr;         // [T, q_lora + 512] bf16: [x wq_a^T | x wkv^T]
  Fp8ActOut cq8;                   // [T, q_lora] the normed q_lora, FP8 (the linears' input)
  uint16_t* q = nullptr;           // [T, H * 512] bf16
  float* proj = nullptr;           // [T, proj_ld] fp32 compressor / weights_proj projections
  int64_t proj_ld = 0;
  uint16_t* idx_q = nullptr;       // [T, nI * 128] bf16 (indexer.wq_b output)
  IndexerQueriesOut idx_queries;   // quantized indexer queries and head weights
  int32_t* picks = nullptr;        // [T, topk] request-local C4A picks
  int32_t* slots = nullptr;        // [T, topk] their global slots
  int32_t* pick_lengths = nullptr; // [T]
  int32_t* c4a_lengths = nullptr;  // [T] min(topk, visible): the C4A plan's lengths
  uint16_t* o = nullptr;           // [T, H * 512] bf16 attention output
  float* out_rope_cs[kNumLayerTypes] = {};  // per layer type [T][32][2]: the output rotation's factors (out_rope.h)
  uint16_t* u = nullptr;           // [T, G * o_lora] bf16 wo_a output
  Fp8ActOut u8;
  uint16_t* y = nullptr;           // [T, D] bf16 layer output

  // Timing (null when the step is not timed): events recorded around each
  // layer's indexer selection; inside a capture they become graph nodes.
  cudaEvent_t* indexer_events = nullptr;  // [2 * layers]
  bool capturing = false;
};

// Marks `point` after the work issued so far on `lane`; lane_wait makes the
// work issued next on `lane` wait for the last mark of `point`. Both do
// nothing in a serial engine. Throw Error on failure.
void lane_mark(const StepBuffers& b, Lane lane, LanePoint point);
void lane_wait(const StepBuffers& b, Lane lane, LanePoint point);

// Records `e` on `stream`; inside a capture (capturing) as an external event
// node, so every replay of the graph records it again. Throws Error on failure.
void record_event(cudaEvent_t e, CUstream_st* stream, bool capturing);

// Owns the activation memory for steps of up to max_tokens rows.
class StepMemory {
 public:
  StepMemory(const ModelConfig& config, IndexKeyFormat keys, int max_tokens);
  ~StepMemory();
  StepMemory(const StepMemory&) = delete;
  StepMemory& operator=(const StepMemory&) = delete;

  // The activation pointers for a step of `tokens` rows (FP8 scale strides
  // follow the row count, as cuBLASLt reads them in place).
  void bind(StepBuffers& b, int tokens) const;
  int64_t bytes() const { return bytes_; }
  int max_tokens() const { return max_tokens_; }

 private:
  struct Layout;
  const ModelConfig& config_;
  IndexKeyFormat keys_;
  int max_tokens_;
  uint8_t* base_ = nullptr;
  int64_t bytes_ = 0;
};

}  // namespace dsv4::cuda
