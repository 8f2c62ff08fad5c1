#pragma once
// The compressor's pooling (SPEC §4.3) as host/device functions, so the CPU
// (attn/cpu/compress_cpu.cpp) and the CUDA kernels (attn/cuda/compressor_*.cu)
// run one implementation and produce the same bits.
//
// Every float operation goes through fmul/fadd/fsub/fdiv below: on the device
// they are the _rn intrinsics, which nvcc never contracts into an FMA; on the
// host the plain operators (the CPU build targets baseline x86-64, no FMA).
#include <bit>
#include <cstdint>

#include "common/hd.h"

// Loop unrolling in device code; host compilers unroll on their own.
#if defined(__CUDA_ARCH__)
#define DSV4_POOL_UNROLL _Pragma("unroll")
#else
#define DSV4_POOL_UNROLL
#endif

namespace dsv4::pool {

DSV4_HD float fmul(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}

DSV4_HD float fadd(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}

DSV4_HD float fsub(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fsub_rn(a, b);
#else
  return a - b;
#endif
}

DSV4_HD float fdiv(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}

// e^x from float operations in a fixed order. std::exp and CUDA's expf are
// both accurate but round differently now and then; this one gives the same
// bits on both backends. Error below 2 ulp (compressor_test measures it).
// x = k ln2 + r with |r| <= ln2/2; e^r by its Taylor polynomial of degree 7
// (truncation error 6e-9 relative); times 2^k in two exact steps.
DSV4_HD float exp_f32(float x) {
  if (!(x == x)) return x;  // NaN
  if (x > 88.72283935546875f) return std::bit_cast<float>(0x7f800000u);  // above ln(FLT_MAX)
  if (x < -103.97908782958984f) return 0.0f;  // below half the smallest subnormal
  // Nearest integer to x / ln2: adding 1.5 * 2^23 rounds to an integer (ties to even).
  const float kf = fsub(fadd(fmul(x, 1.44269502163f), 12582912.0f), 12582912.0f);
  // ln2 = kLn2Hi + kLn2Lo; kLn2Hi has 15 significant bits, so kf * kLn2Hi is
  // exact for |k| <= 256 and x - kf * kLn2Hi is exact (Sterbenz).
  constexpr float kLn2Hi = 0.693145751953125f, kLn2Lo = 1.428606765330187e-06f;
  const float r = fsub(fsub(x, fmul(kf, kLn2Hi)), fmul(kf, kLn2Lo));
  float p = 1.0f / 5040.0f;
  p = fadd(fmul(p, r), 1.0f / 720.0f);
  p = fadd(fmul(p, r), 1.0f / 120.0f);
  p = fadd(fmul(p, r), 1.0f / 24.0f);
  p = fadd(fmul(p, r), 1.0f / 6.0f);
  p = fadd(fmul(p, r), 0.5f);
  p = fadd(fmul(p, r), 1.0f);
  p = fadd(fmul(p, r), 1.0f);
  // 2^k = 2^k1 * 2^k2 with both factors normal floats (k is in [-150, 128]):
  // p * 2^k1 is exact, the second product rounds once (subnormal results).
  const int k = int(kf), k1 = k / 2, k2 = k - k1;
  return fmul(fmul(p, std::bit_cast<float>(uint32_t(k1 + 127) << 23)), std::bit_cast<float>(uint32_t(k2 + 127) << 23));
}

// Slot j a token completes at position pos (pos + 1 a multiple of m).
DSV4_HD int64_t slot_of_position(int64_t pos, int m) { return (pos + 1) / m - 1; }

// The pooled rows of slot j: positions first .. j*m + m - 1. m = 4 pools
// block j-1 (A half) and block j (B half); block -1 does not exist.
DSV4_HD int64_t pool_first(int64_t j, int m) { return m == 4 ? (j > 0 ? (j - 1) * m : 0) : j * m; }
DSV4_HD int pool_count(int64_t j, int m) { return int(j * m + m - pool_first(j, m)); }

// The token of this step that may hold pooled position P of token t's
// window (t at position pos >= P): u = t - (pos - P), the one a run of
// consecutive tokens puts there (u = t: t's own row). When u is in range and
// of t's run at position P, both backends pool the row from u's projection
// ([a | g + ape[P % m]], the bits its state row would hold), never from the
// state cache, so a state block that only this step's tokens fill and no
// later token reads needs no page (CacheSpec::needs_page); otherwise the
// row is the state cache's, through the block table.
DSV4_HD int64_t step_token(int t, int64_t pos, int64_t P) { return int64_t(t) - (pos - P); }

// That token when it holds P (of t's run, at P), else -1: the host's form of
// the test (the CUDA kernels make it with their own loads, step_row).
DSV4_HD int step_row_token(const int32_t* positions, const int32_t* token_run, int t, int64_t P) {
  const int64_t u = step_token(t, positions[t], P);
  return u >= 0 && token_run[u] == token_run[t] && positions[u] == P ? int(u) : -1;
}

// Where row i's half starts in its row: rows i >= b_from belong to block j and
// contribute their B half, b_off further (m = 128: b_off = 0).
DSV4_HD int half_offset(int i, int b_from, int b_off) { return i >= b_from ? b_off : 0; }

// Column `off` of a row's gates: g + ape (ape: nullptr when the row holds the sum).
DSV4_HD float gate(const float* row, const float* ape, int kc, int off) {
  return ape ? fadd(row[kc + off], ape[off]) : row[kc + off];
}

// Channel e of slot j from its n pooled rows; rows(i) is row i (position
// first + i; nullptr: absent) as [a (kc floats) | g + ape (kc floats)].
// Rows i >= b_from belong to block j and contribute their B half (offset
// b_off = c; m = 128: b_off = 0). A softmax over the gates of the present
// rows, then the weighted sum of their values, each in row order.
// kBatch rows are loaded before they are used (a GPU thread then has kBatch
// loads in flight); the arithmetic and its order do not depend on kBatch.
// apes(i): nullptr, or the ape row [kc] to add to row i's gates as it is read
// (a row still in the projection, not yet in the state: the same sum the
// state row holds, so the same bits).
template <int kBatch, typename Rows, typename Apes>
DSV4_HD float pool_channel(const Rows& rows, const Apes& apes, int n, int b_from, int b_off, int kc, int e) {
  const float kNegInf = -std::bit_cast<float>(0x7f800000u);
  float mx = kNegInf;
  for (int i0 = 0; i0 < n; i0 += kBatch) {
    float g[kBatch];
DSV4_POOL_UNROLL
    for (int b = 0; b < kBatch; ++b) {
      const int i = i0 + b;
      const float* r = i < n ? rows(i) : nullptr;
      g[b] = r ? gate(r, apes(i), kc, half_offset(i, b_from, b_off) + e) : kNegInf;  // -inf: no max
    }
DSV4_POOL_UNROLL
    for (int b = 0; b < kBatch; ++b) mx = mx < g[b] ? g[b] : mx;
  }
  float den = 0.0f, num = 0.0f;
  for (int i0 = 0; i0 < n; i0 += kBatch) {
    float a[kBatch], g[kBatch];
    bool present[kBatch];
DSV4_POOL_UNROLL
    for (int b = 0; b < kBatch; ++b) {
      const int i = i0 + b;
      const float* r = i < n ? rows(i) : nullptr;
      const int off = half_offset(i, b_from, b_off) + e;
      present[b] = r != nullptr;
      a[b] = r ? r[off] : 0.0f;
      g[b] = r ? gate(r, apes(i), kc, off) : 0.0f;
    }
DSV4_POOL_UNROLL
    for (int b = 0; b < kBatch; ++b) {
      if (!present[b]) continue;
      const float w = exp_f32(fsub(g[b], mx));
      den = fadd(den, w);
      num = fadd(num, fmul(w, a[b]));
    }
  }
  return fdiv(num, den);
}

// Every row a state row (its gates hold g + ape already).
template <int kBatch, typename Rows>
DSV4_HD float pool_channel(const Rows& rows, int n, int b_from, int b_off, int kc, int e) {
  return pool_channel<kBatch>(rows, [](int) -> const float* { return nullptr; }, n, b_from, b_off, kc, e);
}

}  // namespace dsv4::pool
