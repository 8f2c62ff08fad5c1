#include "attn/cuda/cuda_buffers.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <string>

#include "cache/fp8_ds_mla.h"
#include "common/error.h"

namespace dsv4::cuda {
namespace {

// Carves the activations out of one allocation (base null: only sizes).
// Every array starts at a multiple of 256 bytes.
class Carver {
 public:
  explicit Carver(uint8_t* base) : base_(base) {}
  template <typename T>
  T* take(int64_t count) {
    const int64_t at = used_;
    used_ += (count * int64_t(sizeof(T)) + 255) / 256 * 256;
    return base_ ? reinterpret_cast<T*>(base_ + at) : nullptr;
  }
  int64_t used() const { return used_; }

 private:
  uint8_t* base_;
  int64_t used_ = 0;
};

// The FP8 form of a [rows, cols] activation, scale_ld = rows.
Fp8ActOut fp8_act(Carver& c, int rows, int cols, int capacity) {
  Fp8ActOut a;
  a.data = c.take<uint8_t>(int64_t(capacity) * cols);
  a.scales = c.take<float>(int64_t(capacity) * (cols / kActBlock));
  a.rows = rows, a.cols = cols, a.ld = cols, a.scale_ld = rows;
  return a;
}

// The carving of every buffer, for `tokens` rows of a `capacity`-row pool.
void carve(Carver& c, StepBuffers& b, const ModelConfig& m, IndexKeyFormat keys, int tokens, int capacity) {
  const int64_t T = capacity, D = m.hidden_size, H = m.num_heads, R = m.q_lora_rank;
  const int64_t nI = std::max<int64_t>(m.index_n_heads, kScorerHeads);  // padded heads read zeros
  const int64_t topk = m.index_topk, out = int64_t(m.o_groups) * m.o_lora_rank;
  b.h = c.take<float>(T * D);
  b.x = c.take<uint16_t>(T * D);
  b.x8 = fp8_act(c, tokens, int(D), capacity);
  b.qkv = c.take<uint16_t>(T * (R + kKvDim));
  b.cq8 = fp8_act(c, tokens, int(R), capacity);
  b.q = c.take<uint16_t>(T * H * kKvDim);
  // Compressor wkv | wgate (k = 2 for C4A), indexer compressor wkv | wgate,
  // weights_proj: the widest layer's stack.
  b.proj_ld = 2 * 2 * kKvDim + 2 * 2 * kIndexDim + nI;
  b.proj = c.take<float>(T * b.proj_ld);
  b.idx_q = c.take<uint16_t>(T * nI * kIndexDim);
  b.idx_queries.format = keys;
  b.idx_queries.num_tokens = tokens;
  b.idx_queries.num_heads = int(nI);
  b.idx_queries.codes = c.take<uint8_t>(T * nI * indexer_code_bytes(keys));
  b.idx_queries.scales = c.take<uint8_t>(T * nI * kIndexerScaleBytes);
  b.idx_queries.weights = c.take<float>(T * nI);
  b.picks = c.take<int32_t>(T * topk);
  b.slots = c.take<int32_t>(T * topk);
  b.pick_lengths = c.take<int32_t>(T);
  b.c4a_lengths = c.take<int32_t>(T);
  b.o = c.take<uint16_t>(T * H * kKvDim);
  for (float*& cs : b.out_rope_cs) cs = c.take<float>(T * kRopeDim);
  b.u = c.take<uint16_t>(T * out);
  b.u8 = fp8_act(c, tokens, int(out), capacity);
  b.y = c.take<uint16_t>(T * D);
  b.tokens = tokens;
}

}  // namespace

StepMemory::StepMemory(const ModelConfig& config, IndexKeyFormat keys, int max_tokens)
    : config_(config), keys_(keys), max_tokens_(max_tokens) {
  DSV4_REQUIRE(max_tokens > 0, "cuda backend: the step capacity must be positive");
  Carver sizes(nullptr);
  StepBuffers b;
  carve(sizes, b, config, keys, max_tokens, max_tokens);
  bytes_ = sizes.used();
  const cudaError_t e = cudaMalloc(&base_, size_t(bytes_));
  if (e != cudaSuccess)
    throw Error("cuda backend: cannot allocate " + std::to_string(bytes_ >> 20) + " MiB of activations for steps of " +
                std::to_string(max_tokens) + " tokens: " + cudaGetErrorString(e));
  // Zeros: padding rows and unused columns are read (never used) by whole-row
  // kernels; they must hold defined values.
  if (cudaMemset(base_, 0, size_t(bytes_)) != cudaSuccess) throw Error("cuda backend: cudaMemset failed");
}

StepMemory::~StepMemory() { cudaFree(base_); }

void StepMemory::bind(StepBuffers& b, int tokens) const {
  DSV4_REQUIRE(tokens >= 0 && tokens <= max_tokens_, "cuda backend: a step of " + std::to_string(tokens) +
                                                         " tokens exceeds the capacity of " +
                                                         std::to_string(max_tokens_));
  Carver c(base_);
  carve(c, b, config_, keys_, tokens, max_tokens_);
}

void lane_mark(const StepBuffers& b, Lane lane, LanePoint point) {
  const cudaEvent_t e = b.lane_events[int(point)];
  if (e == nullptr) return;
  const cudaError_t r = cudaEventRecord(e, b.on(lane));
  if (r != cudaSuccess) throw Error(std::string("lane mark: ") + cudaGetErrorString(r));
}

void lane_wait(const StepBuffers& b, Lane lane, LanePoint point) {
  const cudaEvent_t e = b.lane_events[int(point)];
  if (e == nullptr) return;
  const cudaError_t r = cudaStreamWaitEvent(b.on(lane), e, 0);
  if (r != cudaSuccess) throw Error(std::string("lane wait: ") + cudaGetErrorString(r));
}

void record_event(cudaEvent_t e, CUstream_st* stream, bool capturing) {
  const cudaError_t r = capturing ? cudaEventRecordWithFlags(e, stream, cudaEventRecordExternal)
                                  : cudaEventRecord(e, stream);
  if (r != cudaSuccess) throw Error(std::string("event record: ") + cudaGetErrorString(r));
}

}  // namespace dsv4::cuda
