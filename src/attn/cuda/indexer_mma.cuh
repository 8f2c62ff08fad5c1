#pragma once
// Tensor-core pieces of the indexer's scorer (sm_90a): wgmma with A (keys)
// from registers and B (queries) from shared memory, the MXFP4 -> int8
// conversion of key and query codes, and packed bf16 helpers.
//
// Register fragment of A for wgmma m64nNk32 with 8-bit elements (warp w of
// the warpgroup, lane = 4 g + q): register v1 + 2 v2 holds bytes v0 = 0..3
// of row 16 w + g + 8 v1 at k = 4 q + v0 + 16 v2 (CUTLASS ALayout_64x32).
// Accumulator (m64n64): d[4 i + 2 v1 + c] is row 16 w + g + 8 v1, column
// 8 i + 2 q + c.
#include <cstdint>

#include "attn/cuda/warp.cuh"

namespace dsv4::cuda::ix {

// The 32 accumulator operands of an m64n64 wgmma with constraint `con`.
#define DSV4_IX_ACC32(con, d)                                                                                   \
  con(d[0]), con(d[1]), con(d[2]), con(d[3]), con(d[4]), con(d[5]), con(d[6]), con(d[7]), con(d[8]), con(d[9]),  \
      con(d[10]), con(d[11]), con(d[12]), con(d[13]), con(d[14]), con(d[15]), con(d[16]), con(d[17]), con(d[18]), \
      con(d[19]), con(d[20]), con(d[21]), con(d[22]), con(d[23]), con(d[24]), con(d[25]), con(d[26]), con(d[27]), \
      con(d[28]), con(d[29]), con(d[30]), con(d[31])
// One m64n64k32 wgmma step with A in registers; `tail` ends the instruction
// (the e4m3 kinds take their input scales there), `con` constrains D.
#define DSV4_IX_WGMMA_RS(kind, tail, con)                                                                            \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"                                                         \
               "wgmma.mma_async.sync.aligned.m64n64k32." kind                                                      \
               " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, " \
               "%21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, %34, %35}, %36, p" tail       \
               ";\n}\n"                                                                                              \
               : DSV4_IX_ACC32(con, d)                                                                             \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "n"(kScaleD))

// D[64 x 64] (+)= A[64 x 32] B[32 x 64], s8 x s8 -> s32; A in registers, B
// K-major in shared memory (descriptor db). kScaleD = 0 overwrites D, whose
// registers are then outputs only: the chain's first step needs no zeroed
// accumulators (32 moves per chain otherwise). (kScaleD is an immediate: as
// a register operand the compiler may hand it the register of an
// accumulator holding the same value, and ptxas then serializes the chain.)
template <int kScaleD>
__device__ __forceinline__ void wgmma_s8_rs(uint32_t (&d)[32], const uint32_t (&a)[4], uint64_t db) {
  if constexpr (kScaleD == 0) DSV4_IX_WGMMA_RS("s32.s8.s8", "", "=r");
  else DSV4_IX_WGMMA_RS("s32.s8.s8", "", "+r");
}

// The same with e4m3 operands and fp32 accumulation.
template <int kScaleD>
__device__ __forceinline__ void wgmma_e4m3_rs(float (&d)[32], const uint32_t (&a)[4], uint64_t db) {
  if constexpr (kScaleD == 0) DSV4_IX_WGMMA_RS("f32.e4m3.e4m3", ", 1, 1", "=f");
  else DSV4_IX_WGMMA_RS("f32.e4m3.e4m3", ", 1, 1", "+f");
}
#undef DSV4_IX_WGMMA_RS
#undef DSV4_IX_ACC32

// Pins accumulator registers after wgmma_wait (the compiler does not know
// that wgmma writes them asynchronously).
__device__ __forceinline__ void fence_acc(uint32_t (&r)[32]) {
#pragma unroll
  for (int i = 0; i < 32; ++i) asm volatile("" : "+r"(r[i])::"memory");
}
__device__ __forceinline__ void fence_acc(float (&r)[32]) {
#pragma unroll
  for (int i = 0; i < 32; ++i) asm volatile("" : "+f"(r[i])::"memory");
}

// e2m1 codes -> int8 values 2 * e2m1 * 2^shift (shift 0..3: |value| <= 96).
// Magnitudes come from a byte permutation of an 8-entry table, their
// negations from a second one, and a third permutation takes each byte from
// one or the other by the code's sign. The tables depend on the shift only
// (one per key row).
struct E2m1Table {
  uint32_t pos_lo, pos_hi, neg_lo, neg_hi;
};
__device__ __forceinline__ E2m1Table e2m1_table(int shift) {
  const uint32_t pos_lo = 0x03020100u << shift, pos_hi = 0x0c080604u << shift;  // 2 * e2m1 magnitudes << shift
  // bytewise negation (entry 0 stays 0)
  return E2m1Table{pos_lo, pos_hi, (~pos_lo + 0x01010100u) & 0xffffff00u, ~pos_hi + 0x01010101u};
}
// Eight codes (element 0 in the low nibble of w) -> elements 0..3 in lo and
// 4..7 in hi, element 0 in the low byte. (A permutation reads only the low
// 16 bits of its selector, so `sel` and `from` hold both halves' selectors,
// shifted down for hi; every selector nibble is 0..7.) About 11
// instructions a word, where four codes at a time took about 15.
__device__ __forceinline__ void e2m1x8_to_s8(uint32_t w, const E2m1Table& t, uint32_t& lo, uint32_t& hi) {
  const uint32_t sel = w & 0x77777777u;                         // magnitude index per nibble
  const uint32_t from = ((w >> 1) & 0x44444444u) | 0x32103210u;  // byte i: i (magnitude) or 4 + i (negated)
  lo = __byte_perm(__byte_perm(t.pos_lo, t.pos_hi, sel), __byte_perm(t.neg_lo, t.neg_hi, sel), from);
  hi = __byte_perm(__byte_perm(t.pos_lo, t.pos_hi, sel >> 16), __byte_perm(t.neg_lo, t.neg_hi, sel >> 16), from >> 16);
}
// Eight codes as two s8 words each of positive and negative magnitudes
// (2 * |e2m1| << shift; lo, hi as in e2m1x8_to_s8): the dot with the codes
// is dot(pos) - dot(neg). A permutation whose selector nibble has its top
// bit set replicates the selected byte's top bit, 0 for every table entry
// (<= 96), so the raw nibbles select the positive codes' magnitudes and 0 for
// the negative ones, and the nibbles with flipped signs the other way round:
// 7 instructions a word instead of 11, for twice the wgmma steps (only the
// table's magnitudes are read).
__device__ __forceinline__ void e2m1x8_split(uint32_t w, const E2m1Table& t, uint32_t& plo, uint32_t& phi,
                                             uint32_t& nlo, uint32_t& nhi) {
  auto prmt = [](uint32_t a, uint32_t b, uint32_t sel) {  // (prmt's default mode, sign replication included)
    uint32_t d;
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(sel));
    return d;
  };
  const uint32_t f = w ^ 0x88888888u;
  plo = prmt(t.pos_lo, t.pos_hi, w);
  phi = prmt(t.pos_lo, t.pos_hi, w >> 16);
  nlo = prmt(t.pos_lo, t.pos_hi, f);
  nhi = prmt(t.pos_lo, t.pos_hi, f >> 16);
}

// Four codes (the low 16 bits of h16) -> four int8 values, element 0 in the low byte.
__device__ __forceinline__ uint32_t e2m1x4_to_s8(uint32_t h16, int shift) {
  uint32_t lo, hi;
  e2m1x8_to_s8(h16 & 0xffffu, e2m1_table(shift), lo, hi);
  return lo;
}

// cvt.rn.relu.bf16x2: {hi, lo} rounded to bf16 (nearest even), negatives to 0.
__device__ __forceinline__ uint32_t relu_bf16x2(float lo, float hi) {
  uint32_t d;
  asm("cvt.rn.relu.bf16x2.f32 %0, %1, %2;\n" : "=r"(d) : "f"(hi), "f"(lo));
  return d;
}

// indexer_finish for two totals by one cvt.rn.bf16x2.f32: adding +0 first turns
// -0 into +0 (x + 0 is x otherwise); cvt.rn rounds to nearest even as bf16_bits
// does, infinities included. A NaN total stays a NaN (its payload may differ,
// and indexer_order_key ranks every NaN alike).
__device__ __forceinline__ void indexer_finish2(float a, float b, float& ra, float& rb) {
  uint32_t d;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(d) : "f"(__fadd_rn(b, 0.0f)), "f"(__fadd_rn(a, 0.0f)));
  ra = bf16x2_lo(d);
  rb = bf16x2_hi(d);
}

// An s32 accumulator (|v| < 2^22) as float, exactly, in one of three forms
// (SASS on sm_90a, checked with cuobjdump in run AP3):
//  kAluCvt: cvt.rn.f32.s32, one I2FP on the ALU pipe;
//  kXuCvt:  cvt.rm.f32.s32, one I2F on the conversion (XU) pipe, which
//           the rest of the scorer leaves idle (a quarter of the ALU's
//           rate; below 2^24 every rounding mode gives the same float);
//  kMagic:  1.5 * 2^23 + v has exponent 23 and v in its mantissa, then a
//           subtraction: an integer add and a float add.
enum class AccCvt { kMagic = 0, kAluCvt = 1, kXuCvt = 2 };
// (form is a constant once the caller's loop is unrolled.)
__device__ __forceinline__ float s32_to_float_exact(uint32_t v, AccCvt form) {
  if (form == AccCvt::kAluCvt) {
    return __int2float_rn(int(v));
  } else if (form == AccCvt::kXuCvt) {
    float f;
    asm("cvt.rm.f32.s32 %0, %1;" : "=f"(f) : "r"(v));
    return f;
  } else {
    return __fsub_rn(__int_as_float(int(v) + 0x4b400000), 12582912.0f);
  }
}

}  // namespace dsv4::cuda::ix
