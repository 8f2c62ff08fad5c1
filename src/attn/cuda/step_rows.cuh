#pragma once
// A padded step's real row count: StepBuffers::real_tokens, a device int that
// a plain launch writes before the step's kernels (so pdl.cuh lets them read
// it before their wait). Rows at and past it are padding. Null: all are real.
#include <cuda_runtime.h>

#include <cstdint>

namespace dsv4::cuda {

// p: params with num_tokens rows and real_tokens (IndexerSelectParams,
// IndexerQueryParams, AttnParams).
template <typename Params>
__device__ __forceinline__ int real_rows(const Params& p) {
  return p.real_tokens ? min(max(*p.real_tokens, 0), p.num_tokens) : p.num_tokens;
}

}  // namespace dsv4::cuda
