#pragma once
// One step of the runtime (SPEC §7): a batch of runs (a prefill chunk or one
// decode token per request) and the metadata every layer of a type shares,
// built once per step, flat (step/step_layout.h): positions, slot mappings,
// window lists, C128A lists and the block tables of every cache group.
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "cache/block_manager.h"
#include "step/step_layout.h"

namespace dsv4 {

// `len` new tokens of request `request`, at positions start_pos .. start_pos + len - 1.
struct Run {
  int64_t request = 0;
  int64_t start_pos = 0;
  int len = 0;
};

struct RunError {
  size_t run = 0;  // index into the step's input runs
  std::string message;
  bool cache_full = false;  // the caches could not hold it now (CacheExhausted); else the run is bad
};

class StepMetadata {
 public:
  // Accepted runs (a subset of the input, in input order) and their input indices.
  std::vector<Run> runs;
  std::vector<size_t> input_index;

  int num_tokens() const { return dims_.tokens; }
  int num_runs() const { return dims_.runs; }
  const StepDims& dims() const { return dims_; }
  // The flat buffer: one copy of [0, layout().inputs_end) and derive_token on
  // every token rebuild the rest anywhere. A step built without its lists
  // holds the inputs alone (no view(); has_lists() says whether the buffer
  // reaches past them): a backend that derives them itself (the CUDA
  // backend, on the device) needs no more.
  const std::vector<int32_t>& buffer() const { return buffer_; }
  const StepLayout& layout() const { return layout_; }
  bool has_lists() const { return int64_t(buffer_.size()) == layout_.total; }
  StepView view() const;

  std::span<const int32_t> positions() const { return span(layout_.positions, dims_.tokens); }
  std::span<const int32_t> token_run() const { return span(layout_.token_run, dims_.tokens); }
  // First token of run r (r = num_runs(): one past the last token).
  int token_begin(int r) const { return buffer_[size_t(layout_.run_token_begin + r)]; }

  // Builds the buffer for `runs` (already validated and reserved), with the
  // derived lists or without them.
  void build(const BlockManager& blocks, bool lists = true);

 private:
  std::span<const int32_t> span(int64_t off, int64_t n) const { return {buffer_.data() + off, size_t(n)}; }

  StepDims dims_;
  StepLayout layout_ = step_layout(StepDims{});
  std::vector<int32_t> buffer_ = std::vector<int32_t>(size_t(layout_.total), 0);
};

// Validates each run against the block manager (known request, contiguous
// positions, positive length, within max_position_embeddings, not twice in
// the step), reserves its pages and builds the metadata. A run that fails is
// left out with an error; the others proceed. `lists`: build the derived
// lists too (StepMetadata::build).
StepMetadata plan_step(const std::vector<Run>& runs, const ModelConfig& config, BlockManager& blocks,
                       std::vector<RunError>& errors, bool lists = true);

}  // namespace dsv4
