#pragma once
// The inner step of sparse attention on the CPU: all heads of one query token
// against a gathered set of 512-dim entries, one softmax with the per-head sink.

namespace dsv4 {

struct AttendOptions {
  float softmax_scale = 0.0f;
  // Production numerics (SPEC §5): probabilities are rounded to bf16 before
  // P.V while the denominator sums the fp32 values. Exact profile: false.
  bool bf16_probs = false;
};

// q: [num_heads, 512]; keys: [n, 512] (also the values); sink: [num_heads].
// out: [num_heads, 512] (not rounded); lse: [num_heads] (natural log of
// sum exp(s_i), sink excluded; -inf when n == 0). `scratch` needs num_heads * n floats.
void attend_heads(const float* q, int num_heads, const float* keys, int n, const float* sink,
                  const AttendOptions& opt, float* out, float* lse, float* scratch);

}  // namespace dsv4
