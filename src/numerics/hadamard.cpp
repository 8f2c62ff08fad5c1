#include "numerics/hadamard.h"

#include <cmath>
#include <limits>


namespace dsv4 {

void hadamard_rotate(float* x, int n) {
  // Never throws (callers run it inside OpenMP regions): a length that is not
  // a power of two has no such transform, and the result says so with NaN.
  if (n <= 0 || (n & (n - 1)) != 0) {
    for (int i = 0; i < n; ++i) x[i] = std::numeric_limits<float>::quiet_NaN();
    return;
  }
  // Butterflies: pairs (i, i + h) inside blocks of 2h, h = 1, 2, 4, ...
  for (int h = 1; h < n; h *= 2) {
    for (int base = 0; base < n; base += 2 * h) {
      for (int i = base; i < base + h; ++i) {
        const float a = x[i], b = x[i + h];
        x[i] = a + b;
        x[i + h] = a - b;
      }
    }
  }
  const float scale = float(1.0 / std::sqrt(double(n)));
  for (int i = 0; i < n; ++i) x[i] *= scale;
}

}  // namespace dsv4
