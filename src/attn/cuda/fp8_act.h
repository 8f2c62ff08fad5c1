#pragma once
// An FP8 activation as the FP8 linears read it (SPEC §5): each row cut into
// 128-wide blocks, each block e4m3 codes times a power-of-two fp32 scale.
// All pointers are device pointers.
//
// Scale layout: block kb of row m has its scale at scales[kb * scale_ld + m]
// ("M-major": one column of scales per 128-wide block of K), the layout
// cuBLASLt's VEC128_32F mode reads; scale_ld >= rows.
//
// What the linears (attn/cuda/linear.h) need of an activation they read:
// data 16-byte aligned with ld a multiple of 16 (16-byte loads), scales
// 4-byte aligned. cuBLASLt (large M) reads the scales in place when
// scale_ld == rows, rows is a multiple of 8 and scales is 16-byte aligned:
// a producer that writes into a buffer sized for its largest row count
// should use scale_ld = rows of the call. Any other scale_ld works but costs
// the linear one small repack kernel on its cuBLASLt path.
#include <cstdint>
#include <string>

namespace dsv4::cuda {

inline constexpr int kActBlock = 128;

struct Fp8Act {
  const uint8_t* data = nullptr;  // [rows, cols] e4m3, row stride ld bytes
  const float* scales = nullptr;  // see above
  int rows = 0, cols = 0;         // cols a multiple of 128
  int64_t ld = 0, scale_ld = 0;
};

// The same buffers, written by the op that produces the activation.
struct Fp8ActOut {
  uint8_t* data = nullptr;
  float* scales = nullptr;
  int rows = 0, cols = 0;
  int64_t ld = 0, scale_ld = 0;
  operator Fp8Act() const { return Fp8Act{data, scales, rows, cols, ld, scale_ld}; }
};

// Throws Error naming `what` unless `o` can take an FP8 activation of `rows`
// (>= 1) rows and `cols` columns written with 4-byte stores: data and scales
// present and 4-byte aligned, exactly `cols` columns in whole 128-column
// blocks, at least `rows` rows, strides covering both (linear_workspace.cu).
// Every op that writes an FP8 activation checks its output with it.
void check_fp8_out(const Fp8ActOut& o, int rows, int cols, const std::string& what);

}  // namespace dsv4::cuda
