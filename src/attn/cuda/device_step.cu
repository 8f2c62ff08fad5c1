#include "attn/cuda/device_step.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstring>
#include <string>

#include "common/error.h"

namespace dsv4::cuda {
namespace {

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw Error(std::string("device step: ") + what + ": " + cudaGetErrorString(e));
}

constexpr int kThreads = 128;
// Grid-stride kernels: the grid is fixed at capture (capacity-sized work
// would be paid by every replay), the work comes from the staged header.
constexpr int kMaxBlocks = 1024;

// Inputs at capacity: token and run arrays at their capacity lengths,
// padding 0 (positions, runs), so derived entries of padding read nothing;
// the tables' rows of the step's runs re-strided from the staged widths to
// the capacity widths, columns past the staged width -1. Rows of runs past
// the step's keep what an earlier step left: no token of this step names
// them (padding tokens are in run 0).
__global__ void unpack_kernel(const int32_t* __restrict__ staged, StepView v) {
  const StepDims d = read_step_header(staged);
  const StepLayout in = step_layout(d);
  const int T = v.dims.tokens, R = v.dims.runs;
  int64_t n = max(T, R + 1);
  for (int g = 0; g < kNumCacheGroups; ++g) n = max(n, int64_t(d.runs) * v.tables[g].width);
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    if (i < T) {
      const_cast<int32_t*>(v.positions)[i] = i < d.tokens ? staged[in.positions + i] : 0;
      const_cast<int32_t*>(v.token_run)[i] = i < d.tokens ? staged[in.token_run + i] : 0;
    }
    if (i <= R) {
      const_cast<int32_t*>(v.run_token_begin)[i] = i <= d.runs ? staged[in.run_token_begin + i] : d.tokens;
      if (i < R) {
        const_cast<int32_t*>(v.run_start)[i] = i < d.runs ? staged[in.run_start + i] : 0;
        const_cast<int32_t*>(v.run_len)[i] = i < d.runs ? staged[in.run_len + i] : 0;
      }
    }
    for (int g = 0; g < kNumCacheGroups; ++g) {
      const BlockTableView& t = v.tables[g];
      const int w = t.width, ws = d.table_width[g];
      if (i < R) const_cast<int32_t*>(t.first)[i] = i < d.runs ? staged[in.table_first[g] + i] : 0;
      if (i < int64_t(d.runs) * w) {
        const int64_t r = i / w, col = i % w;
        const_cast<int32_t*>(t.pages)[i] = col < ws ? staged[in.table_pages[g] + r * ws + col] : -1;
      }
    }
  }
}

// A block per token (grid-stride): the slots, then the window and C128A
// lists spread over the block's threads (step/step_layout.h's per-element
// functions). A list row gets only its first `length` entries: its readers
// (the attention's IndexList) stop there, and -1 fill to the capacity width
// cost every step of an engine sized for 1M context (8,192 tokens x 8,192
// C128A entries) 272 MB of stores.
__global__ void derive_kernel(const int32_t* __restrict__ staged, StepView v) {
  const int real = read_step_header(staged).tokens;
  for (int t = blockIdx.x; t < v.dims.tokens; t += gridDim.x) {
    if (threadIdx.x == 0) {
      if (t < real) derive_slots(v, t);
      else derive_padding_slots(v, t);
    }
    if (t >= real) continue;  // lengths 0: nothing reads the lists
    int32_t* win = v.window_indices + int64_t(t) * kWindow;
    const int wl = window_length(v.positions[t]), cl = c128a_visible(v, t);
    for (int k = threadIdx.x; k < wl; k += blockDim.x) win[k] = window_entry(v, t, k);
    int32_t* list = v.c128a_indices + int64_t(t) * v.dims.c128a_width;
    for (int j = threadIdx.x; j < cl; j += blockDim.x) list[j] = c128a_entry(v, t, j);
  }
}

__global__ void real_tokens_kernel(const int32_t* __restrict__ staged, int32_t* out) { *out = staged[0]; }

}  // namespace

DeviceStep::DeviceStep(const StepDims& capacity) : capacity_(capacity), layout_(step_layout(capacity)) {
  DSV4_REQUIRE(capacity.tokens > 0 && capacity.runs > 0 && capacity.runs <= capacity.tokens,
               "device step: capacity needs tokens >= runs > 0");
  staging_ints_ = layout_.inputs_end;  // a packed step within the capacity is no larger
  check(cudaMallocHost(&host_staging_, size_t(staging_ints_) * 4), "cudaMallocHost");
  check(cudaMalloc(&device_staging_, size_t(staging_ints_) * 4), "cudaMalloc");
  // One int past the layout: the real token count, for kernels that skip padding.
  check(cudaMalloc(&device_, size_t(layout_.total + 1) * 4), "cudaMalloc");
  check(cudaMemset(device_, 0xff, size_t(layout_.total + 1) * 4), "cudaMemset");
  check(cudaMemset(device_staging_, 0, size_t(staging_ints_) * 4), "cudaMemset");
  std::memset(host_staging_, 0, size_t(staging_ints_) * 4);
  view_ = step_view(device_, capacity_);
}

DeviceStep::~DeviceStep() {
  cudaFreeHost(host_staging_);
  cudaFree(device_staging_);
  cudaFree(device_);
}

void DeviceStep::stage(const StepMetadata& s) {
  const StepDims& d = s.dims();
  DSV4_REQUIRE(d.tokens <= capacity_.tokens && d.runs <= capacity_.runs && d.c128a_width <= capacity_.c128a_width,
               "device step: a step of " + std::to_string(d.tokens) + " tokens in " + std::to_string(d.runs) +
                   " runs (C128A width " + std::to_string(d.c128a_width) + ") exceeds the capacity of " +
                   std::to_string(capacity_.tokens) + " tokens, " + std::to_string(capacity_.runs) +
                   " runs, width " + std::to_string(capacity_.c128a_width));
  for (int g = 0; g < kNumCacheGroups; ++g)
    DSV4_REQUIRE(d.table_width[g] <= capacity_.table_width[g],
                 "device step: the " + std::string(cache_group_name(CacheGroup(g))) + " tables need " +
                     std::to_string(d.table_width[g]) + " blocks per run, the capacity is " +
                     std::to_string(capacity_.table_width[g]));
  staged_ints_ = s.layout().inputs_end;
  std::memcpy(host_staging_, s.buffer().data(), size_t(staged_ints_) * 4);
  staged_tokens_ = d.tokens;
}

void DeviceStep::copy(CUstream_st* stream) {
  check(cudaMemcpyAsync(device_staging_, host_staging_, size_t(staged_ints_) * 4, cudaMemcpyHostToDevice, stream),
        "staging copy");
}

void DeviceStep::build(CUstream_st* stream) {
  int64_t widest = std::max<int64_t>(capacity_.tokens, capacity_.runs + 1);
  for (int g = 0; g < kNumCacheGroups; ++g)
    widest = std::max<int64_t>(widest, int64_t(capacity_.runs) * capacity_.table_width[g]);
  const int64_t unpack_blocks = std::min<int64_t>((widest + kThreads - 1) / kThreads, kMaxBlocks);
  unpack_kernel<<<unsigned(unpack_blocks), kThreads, 0, stream>>>(device_staging_, view_);
  check(cudaGetLastError(), "unpack kernel");
  derive_kernel<<<unsigned(std::min(capacity_.tokens, kMaxBlocks)), kThreads, 0, stream>>>(device_staging_, view_);
  check(cudaGetLastError(), "derive kernel");
  real_tokens_kernel<<<1, 1, 0, stream>>>(device_staging_, device_ + layout_.total);
  check(cudaGetLastError(), "real-tokens kernel");
}

const int32_t* DeviceStep::real_tokens() const { return device_ + layout_.total; }

size_t DeviceStep::device_bytes() const { return size_t(layout_.total + 1 + staging_ints_) * 4; }

}  // namespace dsv4::cuda
