// Instantiations of the small-M kernel for GemvWeight::kW8A16 (a file per kind
// keeps each compilation short).
#include "attn/cuda/linear_gemv.cuh"

namespace dsv4::cuda::detail {

bool gemv_launch_w8a16(const GemvArgs& a, cudaStream_t stream) { return gemv_launch_kind<GemvWeight::kW8A16>(a, stream); }
cudaError_t gemv_configure_w8a16() { return gemv_configure_kind<GemvWeight::kW8A16>(); }

}  // namespace dsv4::cuda::detail
