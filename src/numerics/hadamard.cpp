#include "numerics/hadamard.h"

#include <cmath>

#include "common/error.h"

namespace dsv4 {

void hadamard_rotate(float* x, int n) {
  require(n > 0 && (n & (n - 1)) == 0, "hadamard_rotate: length must be a power of two");
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
