#pragma once
// A step's metadata on the GPU (SPEC §7), built there from what the host
// sends: one copy of the step's input arrays (positions, token -> run, runs,
// block tables; step/step_layout.h) into a staging buffer, then a kernel that
// lays them out at capacity and derives the slot mappings, window lists and
// C128A lists with the same derive_token the CPU runs. So a decode step needs
// no host work beyond one small copy, and every array sits at a fixed device
// address: the kernels of a step can be captured in a CUDA graph once and
// replayed for any later step of the same padded size.
//
// Rows past the step's real tokens (a decode step padded to a graph's batch
// size) get slots -1 and lengths 0: they read and write nothing (SPEC §9).
// Kernels that need the real count read it on the device (real_tokens()).
// Only what a step's kernels read is written: a window or C128A list row
// holds its length's entries (the rest of the row, and padding rows' lists,
// keep older values), and the block tables' rows of the step's runs.
#include <cstdint>
#include <memory>

#include "step/step.h"

struct CUstream_st;

namespace dsv4::cuda {

class DeviceStep {
 public:
  // Capacity: the largest step (tokens, runs, table widths, C128A width)
  // this object holds. Allocates pinned host staging and device memory.
  explicit DeviceStep(const StepDims& capacity);
  ~DeviceStep();
  DeviceStep(const DeviceStep&) = delete;
  DeviceStep& operator=(const DeviceStep&) = delete;

  // Writes the step's inputs into the pinned staging buffer (host work, no
  // CUDA call); throws Error when the step exceeds the capacity. The caller
  // makes sure the previous step's copy has run (steps end with a
  // synchronising read of their output).
  void stage(const StepMetadata& s);
  // Enqueues the copy of the staged inputs (their real size: it stays
  // outside CUDA graphs).
  void copy(CUstream_st* stream);
  // Enqueues the kernels that lay the copied inputs out at capacity and
  // derive the rest: capturable, a graph replays them for any later step.
  void build(CUstream_st* stream);

  // The capacity layout's arrays on the device (dims = the capacity).
  const StepView& view() const { return view_; }
  // Device int: the real token count of the staged step (row t >= it is padding).
  const int32_t* real_tokens() const;
  const StepDims& capacity() const { return capacity_; }
  int staged_tokens() const { return staged_tokens_; }
  size_t device_bytes() const;

 private:
  StepDims capacity_;
  int64_t staging_ints_ = 0;   // the largest packed inputs the staging buffers hold
  int64_t staged_ints_ = 0;    // the staged step's
  StepLayout layout_;          // the device buffer's (capacity) layout
  int32_t* host_staging_ = nullptr;    // pinned
  int32_t* device_staging_ = nullptr;  // packed inputs, as the host wrote them
  int32_t* device_ = nullptr;          // capacity layout
  StepView view_{};
  int staged_tokens_ = 0;
};

}  // namespace dsv4::cuda
