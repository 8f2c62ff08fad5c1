#pragma once
// wgmma m64nNk32 with e4m3 A and B both K-major in shared memory (matrix
// descriptors da, db), fp32 accumulators: D[64 x N] (+)= A[64 x 32] B[32 x N].
// kScaleD = 0 overwrites D, whose registers are then outputs only (the first
// step of a chain needs no zeroed accumulators); it is an immediate, as in
// indexer_mma.cuh. Accumulator layout (warp w of the warpgroup, lane 4 g + q):
// d[4 i + 2 v + c] is row 16 w + g + 8 v, column 8 i + 2 q + c.
// Defined for N = 8, 16, 32, 64, 128.
//
// Also wgmma m64nNk16 with bf16 A in registers (a[0..3]: the fragment of
// mma.m16n8k16 per warp, warp w holding rows 16 w ..) and bf16 B K-major in
// shared memory: the FP8-weight x bf16 GEMM (linear_gemm.cu) decodes its
// weight into A. Defined for N = 8, 16, 32, 64, 128.
#include <cstdint>

namespace dsv4::cuda {

template <int N, int kScaleD>
__device__ __forceinline__ void wgmma_e4m3_ss(float (&d)[N / 2], uint64_t da, uint64_t db);

// DSV4_E4M3_Dn: accumulator operands d[o] .. d[o + n - 1] with constraint con.
#define DSV4_E4M3_D4(con, o) con(d[o]), con(d[o + 1]), con(d[o + 2]), con(d[o + 3])
#define DSV4_E4M3_D8(con, o) DSV4_E4M3_D4(con, o), DSV4_E4M3_D4(con, o + 4)
#define DSV4_E4M3_D16(con, o) DSV4_E4M3_D8(con, o), DSV4_E4M3_D8(con, o + 8)
#define DSV4_E4M3_D32(con, o) DSV4_E4M3_D16(con, o), DSV4_E4M3_D16(con, o + 16)
#define DSV4_E4M3_D64(con, o) DSV4_E4M3_D32(con, o), DSV4_E4M3_D32(con, o + 32)
#define DSV4_E4M3_OUT(x) "=f"(x)
#define DSV4_E4M3_INOUT(x) "+f"(x)

template <int N, int kScaleD>
__device__ __forceinline__ void wgmma_bf16_rs(float (&d)[N / 2], const uint32_t (&a)[4], uint64_t db);

// The specializations fn<N, 0> and fn<N, 1>: `ptx` is the instruction with
// its operands ("%0 .." the N / 2 accumulators first) up to the scale-d
// predicate p, `dn` the operand macro for the accumulators, `params` the
// parameters after d (in parentheses), then the input operands.
#define DSV4_WGMMA_STRIP(...) __VA_ARGS__
#define DSV4_WGMMA_ONE(fn, N, S, con, dn, ptx, params, ...)                                   \
  template <>                                                                                 \
  __device__ __forceinline__ void fn<N, S>(float (&d)[N / 2], DSV4_WGMMA_STRIP params) {      \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, " #S ", 0;\n" ptx ";\n}\n"                 \
                 : dn(con, 0)                                                                 \
                 : __VA_ARGS__);                                                              \
  }
#define DSV4_WGMMA_PAIR(fn, N, dn, ptx, params, ...)                             \
  DSV4_WGMMA_ONE(fn, N, 0, DSV4_E4M3_OUT, dn, ptx, params, __VA_ARGS__) \
  DSV4_WGMMA_ONE(fn, N, 1, DSV4_E4M3_INOUT, dn, ptx, params, __VA_ARGS__)

// e4m3 x e4m3: `regs` the accumulator list, `descs` the two descriptor operands.
#define DSV4_E4M3_SS(N, regs, descs, dn)                                                                         \
  DSV4_WGMMA_PAIR(wgmma_e4m3_ss, N, dn,                                                                          \
                  "wgmma.mma_async.sync.aligned.m64n" #N "k32.f32.e4m3.e4m3 {" regs "}, " descs ", p, 1, 1",    \
                  (uint64_t da, uint64_t db), "l"(da), "l"(db))
// bf16 with A in registers: `aregs` the four A operands and the B descriptor.
#define DSV4_BF16_RS(N, regs, aregs, dn)                                                                         \
  DSV4_WGMMA_PAIR(wgmma_bf16_rs, N, dn,                                                                          \
                  "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32.bf16.bf16 {" regs "}, " aregs ", p, 1, 1, 0", \
                  (const uint32_t(&a)[4], uint64_t db), "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db))

DSV4_E4M3_SS(8, "%0, %1, %2, %3", "%4, %5", DSV4_E4M3_D4)
DSV4_E4M3_SS(16, "%0, %1, %2, %3, %4, %5, %6, %7", "%8, %9", DSV4_E4M3_D8)
DSV4_E4M3_SS(32, "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15", "%16, %17", DSV4_E4M3_D16)
DSV4_E4M3_SS(64, "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31", "%32, %33", DSV4_E4M3_D32)
DSV4_E4M3_SS(128, "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63", "%64, %65", DSV4_E4M3_D64)
DSV4_BF16_RS(8, "%0, %1, %2, %3", "{%4, %5, %6, %7}, %8", DSV4_E4M3_D4)
DSV4_BF16_RS(16, "%0, %1, %2, %3, %4, %5, %6, %7", "{%8, %9, %10, %11}, %12", DSV4_E4M3_D8)
DSV4_BF16_RS(32, "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15", "{%16, %17, %18, %19}, %20", DSV4_E4M3_D16)
DSV4_BF16_RS(64, "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31", "{%32, %33, %34, %35}, %36", DSV4_E4M3_D32)
DSV4_BF16_RS(128, "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63", "{%64, %65, %66, %67}, %68", DSV4_E4M3_D64)

#undef DSV4_BF16_RS
#undef DSV4_E4M3_SS
#undef DSV4_WGMMA_PAIR
#undef DSV4_WGMMA_ONE
#undef DSV4_WGMMA_STRIP
#undef DSV4_E4M3_INOUT
#undef DSV4_E4M3_OUT
#undef DSV4_E4M3_D64
#undef DSV4_E4M3_D32
#undef DSV4_E4M3_D16
#undef DSV4_E4M3_D8
#undef DSV4_E4M3_D4

}  // namespace dsv4::cuda
