// A host model of the order c128a-entry-phases.patch pools a C128A channel
// in, against the CPU's pool_channel (attn/compressor_math.h): absent rows
// staged as a = 0, g = -inf and summed instead of skipped; the maximum taken
// in 4 parts of 32 rows, each over 4 interleaved partial maxima, then the 4
// parts combined; weights and sums in row order. It prints how many channels
// differ in their bits (NaN counts as equal to NaN).
//
//   g++ -std=c++20 -O2 -I src docs/experiments/wide_pool_order_model.cpp -o /tmp/model && /tmp/model
//
// The cases: random gates and values; gates whose maximum is a tie of +0
// and -0; NaN gates and values; +-inf gates; gates spread wide enough that
// most weights underflow; a quarter of the rows absent; every row absent.
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <random>
#include <vector>

#include "attn/compressor_math.h"

namespace {

float max_step(float m, float g) { return m < g ? g : m; }

// The patch's kernel for one channel: a and g of the 128 rows as staged.
float pool_like_the_kernel(const float (&a)[128], const float (&g)[128]) {
  float part[4];
  for (int p = 0; p < 4; ++p) {
    float m[4] = {-INFINITY, -INFINITY, -INFINITY, -INFINITY};
    for (int u = 0; u < 32; ++u) m[u % 4] = max_step(m[u % 4], g[32 * p + u]);
    part[p] = max_step(max_step(m[0], m[1]), max_step(m[2], m[3]));
  }
  float mx = -INFINITY;
  for (float p : part) mx = max_step(mx, p);
  float den = 0.0f, num = 0.0f;
  for (int i = 0; i < 128; ++i) {
    const float w = dsv4::pool::exp_f32(dsv4::pool::fsub(g[i], mx));
    den = dsv4::pool::fadd(den, w);
    num = dsv4::pool::fadd(num, dsv4::pool::fmul(w, a[i]));
  }
  return dsv4::pool::fdiv(num, den);
}

float draw(std::mt19937_64& rng, int mode) {
  const float f = std::uniform_real_distribution<float>(-4.0f, 4.0f)(rng);
  switch (mode) {
    case 1: return rng() % 3 == 0 ? ((rng() & 1) ? 0.0f : -0.0f) : -std::fabs(f) - 1.0f;  // zeros tie at the max
    case 2: return rng() % 50 == 0 ? NAN : f;
    case 3: return rng() % 50 == 0 ? ((rng() & 1) ? INFINITY : -INFINITY) : f;
    case 4: return 40.0f * f;  // most weights underflow
    default: return f;
  }
}

}  // namespace

int main() {
  constexpr int kRows = 128, kc = 512;
  std::mt19937_64 rng(7);
  long channels = 0, differ = 0;
  for (int trial = 0; trial < 20000; ++trial) {
    const int mode = trial % 6;
    std::vector<std::vector<float>> rows(kRows, std::vector<float>(2 * kc));
    std::vector<const float*> at(kRows);
    for (int i = 0; i < kRows; ++i) {
      for (float& f : rows[size_t(i)]) f = draw(rng, mode);
      const bool absent = (mode == 5 && rng() % 4 == 0) || trial % 97 == 0;
      at[size_t(i)] = absent ? nullptr : rows[size_t(i)].data();
    }
    auto row = [&](int i) { return at[size_t(i)]; };
    for (int k = 0; k < 8; ++k) {
      const int e = int(rng() % kc);
      const float want = dsv4::pool::pool_channel<32>(row, kRows, 0, 0, kc, e);
      float a[kRows], g[kRows];
      for (int i = 0; i < kRows; ++i) {
        a[i] = at[size_t(i)] ? at[size_t(i)][e] : 0.0f;
        g[i] = at[size_t(i)] ? at[size_t(i)][kc + e] : -INFINITY;
      }
      const float got = pool_like_the_kernel(a, g);
      ++channels;
      const bool same = std::bit_cast<uint32_t>(got) == std::bit_cast<uint32_t>(want) || (std::isnan(got) && std::isnan(want));
      if (!same && ++differ <= 10) std::printf("mode %d: want %a got %a\n", mode, want, got);
    }
  }
  std::printf("%ld channels, %ld differ\n", channels, differ);
  return differ == 0 ? 0 : 1;
}
