// Instantiations of the small-M kernel for GemvWeight::kBf16 (a file per kind
// keeps each compilation short).
#include "attn/cuda/linear_gemv.cuh"

namespace dsv4::cuda::detail {

bool gemv_launch_bf16(const GemvArgs& a, cudaStream_t stream) { return gemv_launch_kind<GemvWeight::kBf16>(a, stream); }
cudaError_t gemv_configure_bf16() { return gemv_configure_kind<GemvWeight::kBf16>(); }

}  // namespace dsv4::cuda::detail
