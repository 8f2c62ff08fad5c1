// Instantiations of the small-M kernel for GemvWeight::kFp8 (a file per kind
// keeps each compilation short).
#include "attn/cuda/linear_gemv.cuh"

namespace dsv4::cuda::detail {

bool gemv_launch_fp8(const GemvArgs& a, cudaStream_t stream) { return gemv_launch_kind<GemvWeight::kFp8>(a, stream); }
cudaError_t gemv_configure_fp8() { return gemv_configure_kind<GemvWeight::kFp8>(); }

}  // namespace dsv4::cuda::detail
