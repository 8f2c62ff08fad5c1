#pragma once
// DSV4_HD marks small functions that host and device code share (numerics,
// slot arithmetic), so the CPU and CUDA backends run one implementation.
// Plain constexpr functions are callable from device code as well (the CUDA
// targets build with --expt-relaxed-constexpr); this macro is for the ones
// that cannot be constexpr.
#if defined(__CUDACC__)
#define DSV4_HD __host__ __device__ __forceinline__
#else
#define DSV4_HD inline
#endif
