// The linears (attn/cuda/linear.h) against the CPU twin Linear
// (attn/cpu/linear.h, production profile) on the same random bf16-valued
// inputs and the same FP8 / bf16 weights, every path at the same row counts.
//
// Bounds. Both backends sum the same exact products (e4m3 x e4m3, e4m3 x
// bf16 and bf16 x bf16 products are exact in fp32) in different orders, then
// round to bf16. With S = sum_k |x_k w_k| (computed on the CPU) and g the
// GPU's output, the test checks against the CPU's fp32 sum c of the same
// products (before rounding):
//     |g - c| <= 2^-8 |g| + e S
// (2^-8 |g|: g is c' rounded to bf16, |g - c'| <= half an ulp <= 2^-8 |g|;
// e S: |c' - c|, two fp32 summation orders), and against the CPU twin's own
// bf16 output cpu (each a rounding of its own sum, so they may differ by one
// ulp): |g - cpu| <= 2^-8 (|g| + |cpu|) + 2 e S. fp32 outputs drop the 2^-8
// terms. e per path:
//   own kernel            2^-18: fp32 tensor-core accumulation restarted
//                         every 128 k (or over at most a few hundred k)
//   cuBLASLt FP8, and     2^-11: Hopper's FP8 MMAs keep fewer accumulator
//   the own FP8 GEMM      bits inside each 128-wide block (DeepSeek-V3 report:
//                         about 14); the scales are applied at block ends
//   cuBLASLt bf16         2^-16: fp32 MMA accumulation over all of k
// Rows a path did not take use the other path's e (the route says which).
// Inputs have per-block magnitudes spread over 2^+-4 and 1/16 tiny elements
// (e4m3 subnormal codes), so a wrong scale, block or layout shows up far
// outside the bounds; every comparison prints max |diff| / S.
//
// Every test also checks: outputs poisoned (NaN) before each run are all
// written; guard rows and columns around the outputs are untouched; two runs
// are bitwise equal; NaN never passes.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <span>
#include <stdexcept>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "support/cuda_device.h"
#include "attn/cpu/linear.h"
#include "attn/cpu/sgemm.h"
#include "attn/cuda/linear.h"
#include "attn/cuda/linear_internal.h"
#include "attn/cuda/q_head_norm_rope.h"
#include "attn/cuda/residual_norm.h"
#include "common/error.h"
#include "model/weights.h"
#include "numerics/bf16.h"
#include "numerics/e4m3.h"
#include "numerics/quant.h"
#include "numerics/rope.h"
#include "support/error_of.h"

namespace dsv4::test {
namespace {

using cuda::Bf16Linear;
using cuda::Fp8Act;
using cuda::Fp8ActOut;
using cuda::Fp8Linear;
using cuda::LinearOptions;
using cuda::LinearPath;
using cuda::LinearRoute;
using cuda::LinearWorkspace;
using cuda::W8A16GroupedLinear;
using cuda::W8A16Options;

constexpr double kEOwn = 0x1p-18;
constexpr double kECublasFp8 = 0x1p-11;
constexpr double kECublasBf16 = 0x1p-16;
constexpr uint16_t kPoison16 = 0x7fc1;  // a bf16 NaN
constexpr uint32_t kPoison32 = 0x7fc00001u;  // an fp32 NaN
constexpr uint8_t kPoison8 = 0x7f;      // the e4m3 NaN

void cuda_ok(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(e));
}

// Device copy of a host vector; download() reads it back.
template <typename T>
class DeviceArray {
 public:
  explicit DeviceArray(const std::vector<T>& host) : n_(host.size()) {
    cuda_ok(cudaMalloc(&p_, std::max<size_t>(1, n_) * sizeof(T)), "cudaMalloc");
    upload(host);
  }
  ~DeviceArray() { cudaFree(p_); }
  DeviceArray(const DeviceArray&) = delete;
  DeviceArray& operator=(const DeviceArray&) = delete;
  T* get() const { return p_; }
  void upload(const std::vector<T>& host) {
    cuda_ok(cudaMemcpy(p_, host.data(), n_ * sizeof(T), cudaMemcpyHostToDevice), "upload");
  }
  std::vector<T> download() const {
    std::vector<T> h(n_);
    cuda_ok(cudaMemcpy(h.data(), p_, n_ * sizeof(T), cudaMemcpyDeviceToHost), "download");
    return h;
  }

 private:
  T* p_ = nullptr;
  size_t n_ = 0;
};

void sync() { cuda_ok(cudaDeviceSynchronize(), "cudaDeviceSynchronize"); }

// ---- random inputs ------------------------------------------------------------

// N(0, sigma) times 2^u per block (u uniform in [-spread, spread]); 1 element
// in 16 scaled by 2^-14 (e4m3 subnormal codes once quantized).
float draw(std::mt19937_64& rng, float sigma, int u) {
  std::normal_distribution<float> normal(0.0f, sigma);
  float v = normal(rng) * std::ldexp(1.0f, u);
  if (rng() % 16 == 0) v *= 0x1p-14f;
  return v;
}

// [m, k] bf16-valued activations, magnitudes per (row, 128-block).
std::vector<float> random_activation(int m, int64_t k, std::mt19937_64& rng) {
  std::vector<float> x(size_t(m) * size_t(k));
  for (int r = 0; r < m; ++r)
    for (int64_t b = 0; b < k; b += 128) {
      const int u = int(rng() % 9) - 4;
      for (int64_t c = b; c < std::min(k, b + 128); ++c) x[size_t(r * k + c)] = round_bf16(draw(rng, 1.0f, u));
    }
  return x;
}

// The first `cols` columns of each of the m rows of x (row stride k) at row
// stride ld, zeros between.
std::vector<float> rows_at_stride(const std::vector<float>& x, int m, int64_t k, int64_t ld, int64_t cols) {
  std::vector<float> out(size_t(m) * size_t(ld), 0.0f);
  for (int r = 0; r < m; ++r) std::copy_n(x.begin() + r * k, cols, out.begin() + r * ld);
  return out;
}

// Weight values ~ N(0, 1/cols), magnitudes per 128x128 block.
std::vector<float> random_weight_values(int64_t rows, int64_t cols, std::mt19937_64& rng) {
  const int64_t rb = (rows + 127) / 128, cb = (cols + 127) / 128;
  std::vector<int> u(size_t(rb * cb));
  for (int& e : u) e = int(rng() % 7) - 3;
  std::vector<float> w(size_t(rows * cols));
  const float sigma = 1.0f / std::sqrt(float(cols));
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) w[size_t(r * cols + c)] = draw(rng, sigma, u[size_t((r / 128) * cb + c / 128)]);
  return w;
}

WeightMatrix random_fp8(const std::string& name, int64_t rows, int64_t cols, std::mt19937_64& rng) {
  return quantize_fp8_matrix(name, random_weight_values(rows, cols, rng), rows, cols);
}

WeightMatrix random_bf16(const std::string& name, int64_t rows, int64_t cols, std::mt19937_64& rng) {
  const std::vector<float> v = random_weight_values(rows, cols, rng);
  WeightMatrix m;
  m.name = name;
  m.rows = rows, m.cols = cols;
  m.dtype = DType::kBF16;
  m.owned.resize(v.size() * 2);
  for (size_t i = 0; i < v.size(); ++i) {
    const uint16_t b = bf16_bits(v[i]);
    std::memcpy(m.owned.data() + 2 * i, &b, 2);
  }
  m.data = m.owned;
  return m;
}

std::vector<uint16_t> to_bf16(const std::vector<float>& v) {
  std::vector<uint16_t> b(v.size());
  for (size_t i = 0; i < v.size(); ++i) b[i] = bf16_bits(v[i]);
  return b;
}

std::vector<const WeightMatrix*> pointers(const std::vector<WeightMatrix>& parts) {
  std::vector<const WeightMatrix*> p;
  for (const WeightMatrix& w : parts) p.push_back(&w);
  return p;
}

// The stacked weight as fp32 [n, k].
std::vector<float> dequantized(const std::vector<WeightMatrix>& parts) {
  std::vector<float> w;
  for (const WeightMatrix& p : parts) {
    const std::vector<float> d = p.dequantize();
    w.insert(w.end(), d.begin(), d.end());
  }
  return w;
}

// ---- references ---------------------------------------------------------------

std::vector<float> absolute(const std::vector<float>& v) {
  std::vector<float> a(v.size());
  for (size_t i = 0; i < v.size(); ++i) a[i] = std::fabs(v[i]);
  return a;
}

// c = x w^T and s = |x| |w|^T for x [m, k] (row stride ldx), w [n, k] (aw =
// |w|), into rows of stride ldo.
void reference(const float* x, int64_t ldx, int m, const float* w, const float* aw, int64_t n, int64_t k, float* c,
               float* s, int64_t ldo) {
  sgemm_nt(m, int(n), int(k), x, int(ldx), w, int(k), c, int(ldo));
  std::vector<float> ax(size_t(m) * size_t(k));
  for (int r = 0; r < m; ++r)
    for (int64_t i = 0; i < k; ++i) ax[size_t(r * k + i)] = std::fabs(x[r * ldx + i]);
  sgemm_nt(m, int(n), int(k), ax.data(), int(k), aw, int(k), s, int(ldo));
}

std::vector<float> fake_quantized(std::vector<float> x) {
  fake_quant_e4m3(x.data(), x.size(), kGemmQuantBlock);
  return x;
}

// ---- comparison -----------------------------------------------------------------

// |a - b| <= ra |a| + rb |b| + e[row] s for every element of [m, n] (a and b
// with row strides lda, ldb; s [m, n]). Reports the first failure and the
// largest |a - b| / s.
void expect_close(const std::string& label, const std::vector<float>& a, int64_t lda, const std::vector<float>& b,
                  int64_t ldb, const std::vector<float>& s, int m, int64_t n, double ra, double rb,
                  const std::vector<double>& e) {
  int64_t bad = 0;
  double worst = 0.0;
  std::string first;
  for (int r = 0; r < m; ++r)
    for (int64_t c = 0; c < n; ++c) {
      const double x = a[size_t(r * lda + c)], y = b[size_t(r * ldb + c)], sum = s[size_t(r * n + c)];
      const double d = std::fabs(x - y);
      const bool ok = d <= ra * std::fabs(x) + rb * std::fabs(y) + e[size_t(r)] * sum;  // false for NaN
      if (sum > 0) worst = std::max(worst, d / sum);
      if (!ok && bad++ == 0) {
        char buf[256];
        std::snprintf(buf, sizeof buf, "row %d col %lld: %.9g vs %.9g (|diff| %.3g, bound %.3g, sum|xw| %.3g)", r,
                      (long long)c, x, y, d, ra * std::fabs(x) + rb * std::fabs(y) + e[size_t(r)] * sum, sum);
        first = buf;
      }
    }
  EXPECT_EQ(bad, 0) << label << ": " << bad << " of " << int64_t(m) * n << " outside the bound; first at " << first;
  std::printf("    %-44s max |diff| / sum|xw| = 2^%.1f\n", label.c_str(), worst > 0 ? std::log2(worst) : -99.0);
}

// e per row: rows below cublas_rows went through cuBLASLt (or all rows
// through the FP8 GEMM, which takes a call whole).
std::vector<double> row_bounds(const LinearRoute& route, int m, double e_cublas) {
  std::vector<double> e(size_t(m), kEOwn);
  for (int r = 0; r < route.cublas_rows + route.gemm_rows && r < m; ++r) e[size_t(r)] = e_cublas;
  return e;
}

std::string path_name(LinearPath p) {
  switch (p) {
    case LinearPath::kCublas: return " cublas";
    case LinearPath::kSmallM: return " own";
    case LinearPath::kGemm: return " gemm";
    default: return " auto";
  }
}

std::vector<double> sum_bounds(const std::vector<double>& a, const std::vector<double>& b) {
  std::vector<double> s(a.size());
  for (size_t i = 0; i < a.size(); ++i) s[i] = a[i] + b[i];
  return s;
}

std::vector<float> bf16_values(const std::vector<uint16_t>& v) {
  std::vector<float> f(v.size());
  for (size_t i = 0; i < v.size(); ++i) f[i] = bf16_to_float(v[i]);
  return f;
}

// The guard of an output [rows_alloc, ld]: rows >= m and columns >= n must
// still hold the poison.
template <typename T>
void expect_guard(const std::string& label, const std::vector<T>& out, int m, int64_t n, int64_t ld, T poison) {
  int64_t bad = 0;
  for (size_t i = 0; i < out.size(); ++i) {
    const int64_t r = int64_t(i) / ld, c = int64_t(i) % ld;
    if ((r >= m || c >= n) && out[i] != poison) ++bad;
  }
  EXPECT_EQ(bad, 0) << label << ": " << bad << " elements written outside the output";
}

// Checks a GPU Fp8Act against the CPU quantizer applied to rows of v (row
// stride ldv): codes and scales bit for bit; guard bytes untouched.
void expect_quantized(const std::string& label, const std::vector<float>& v, int64_t ldv, int m, int64_t k,
                      const std::vector<uint8_t>& data, int64_t ld, const std::vector<float>& scales, int64_t scale_ld) {
  int64_t bad = 0;
  std::string first;
  std::vector<uint8_t> codes(128);
  for (int r = 0; r < m; ++r)
    for (int64_t b = 0; b < k / 128; ++b) {
      const int e = quantize_e4m3_block(v.data() + r * ldv + b * 128, 128, codes.data());
      const float s = scales[size_t(b * scale_ld + r)], want = exp2_int(e);
      if (std::memcmp(&s, &want, 4) != 0 && bad++ == 0)
        first = "scale of row " + std::to_string(r) + " block " + std::to_string(b) + ": " + std::to_string(s) +
                " vs 2^" + std::to_string(e);
      for (int i = 0; i < 128; ++i)
        if (data[size_t(r * ld + b * 128 + i)] != codes[size_t(i)] && bad++ == 0)
          first = "code of row " + std::to_string(r) + " col " + std::to_string(b * 128 + i) + ": " +
                  std::to_string(data[size_t(r * ld + b * 128 + i)]) + " vs " + std::to_string(codes[size_t(i)]);
    }
  EXPECT_EQ(bad, 0) << label << ": first mismatch " << first;
  int64_t guard = 0;
  for (size_t i = 0; i < data.size(); ++i)
    if ((int64_t(i) / ld >= m || int64_t(i) % ld >= k) && data[i] != kPoison8) ++guard;
  for (size_t i = 0; i < scales.size(); ++i) {
    uint32_t bits;
    std::memcpy(&bits, &scales[i], 4);
    if ((int64_t(i) % scale_ld >= m || int64_t(i) / scale_ld >= k / 128) && bits != kPoison32) ++guard;
  }
  EXPECT_EQ(guard, 0) << label << ": " << guard << " FP8 bytes or scales written outside the activation";
}

float poison_f32() {
  float f;
  std::memcpy(&f, &kPoison32, 4);
  return f;
}

// A device FP8 activation with guards: m + 1 rows of ld = k + pad bytes,
// scales [k / 128 + 1][scale_ld] (default m + 4).
struct DeviceAct {
  int m;
  int64_t k, ld, scale_ld;
  std::unique_ptr<DeviceArray<uint8_t>> data;
  std::unique_ptr<DeviceArray<float>> scales;
  DeviceAct(int m_, int64_t k_, int64_t scale_ld_ = -1, int64_t pad = 16) : m(m_), k(k_), ld(k_ + pad) {
    scale_ld = scale_ld_ >= 0 ? scale_ld_ : m + 4;
    data = std::make_unique<DeviceArray<uint8_t>>(std::vector<uint8_t>(size_t((m + 1) * ld), kPoison8));
    scales = std::make_unique<DeviceArray<float>>(std::vector<float>(size_t((k / 128 + 1) * scale_ld), poison_f32()));
  }
  Fp8ActOut out() const { return Fp8ActOut{data->get(), scales->get(), m, int(k), ld, scale_ld}; }
};

// x (m rows of k) quantized by the GPU's quantize_act into a DeviceAct with
// scale_ld = m and rows `pad` bytes longer than k.
DeviceAct quantized_on_gpu(const std::vector<float>& x, int m, int64_t k, int64_t pad = 0) {
  DeviceArray<uint16_t> xd(to_bf16(x));
  DeviceAct act(m, k, m, pad);
  cuda::quantize_act(xd.get(), k, act.out(), nullptr);
  sync();  // before xd is freed
  return act;
}

// ---- the FP8 linear ---------------------------------------------------------------

struct PathResult {
  bool ran = false;
  std::vector<float> y;
  LinearRoute route;
};

// Runs the FP8 linear of `parts` at every m of `ms` on the paths given,
// checking each against the CPU twin and the paths against each other. The
// activation's rows are act_pad bytes longer than k (0: contiguous, what
// cuBLASLt must take; with padding only the own kernel is required to run).
void check_fp8_linear(const std::string& name, const std::vector<WeightMatrix>& parts, const std::vector<int>& ms,
                      const std::vector<LinearPath>& paths, uint64_t seed, int64_t act_pad = 0, int splits = 0) {
  std::mt19937_64 rng(seed);
  const std::vector<const WeightMatrix*> ptrs = pointers(parts);
  Fp8Linear gpu(ptrs, LinearOptions{LinearPath::kAuto, 32, splits});
  const int64_t n = gpu.out_features(), k = gpu.in_features();
  const int max_m = *std::max_element(ms.begin(), ms.end());
  LinearWorkspace ws({gpu.needs(max_m)});
  std::vector<Linear> cpu;
  for (const WeightMatrix& w : parts) cpu.emplace_back(&w, LinearMode::kFp8, true);
  const std::vector<float> w = dequantized(parts), aw = absolute(w);
  const int64_t ldy = n + 8;

  for (int m : ms) {
    const std::string at = name + " m=" + std::to_string(m);
    const std::vector<float> x = random_activation(m, k, rng);
    // The activation through the GPU quantizer (checked bit for bit), with scale_ld = m.
    const DeviceAct act = quantized_on_gpu(x, m, k, act_pad);
    expect_quantized(at + " quantize_act", x, k, m, k, act.data->download(), act.ld, act.scales->download(), m);

    // References: fp32 sums of the quantized products, sum |x w|, the CPU twin.
    const std::vector<float> xq = fake_quantized(x);
    std::vector<float> c(size_t(m) * size_t(n)), s(c.size()), ycpu(size_t(m) * size_t(n));
    reference(xq.data(), k, m, w.data(), aw.data(), n, k, c.data(), s.data(), n);
    int64_t col = 0;
    for (size_t p = 0; p < parts.size(); ++p) {
      cpu[p].forward(x.data(), int(k), m, ycpu.data() + col, int(n), Profile::kProduction);
      col += parts[p].rows;
    }

    std::vector<PathResult> results(paths.size());
    for (size_t pi = 0; pi < paths.size(); ++pi) {
      gpu.set_options({paths[pi], 32, splits});
      const std::string label = at + path_name(paths[pi]);
      std::vector<std::vector<uint16_t>> runs;
      for (int rep = 0; rep < 2; ++rep) {
        DeviceArray<uint16_t> y(std::vector<uint16_t>(size_t((m + 2) * ldy), kPoison16));
        gpu.forward(Fp8Act(act.out()), y.get(), ldy, ws, nullptr);
        sync();
        runs.push_back(y.download());
      }
      const LinearRoute route = gpu.last_route();
      EXPECT_EQ(route.cublas_rows + route.kernel_rows + route.gemm_rows, m) << label;
      if (paths[pi] == LinearPath::kGemm) EXPECT_EQ(route.gemm_rows, m) << label;
      if (paths[pi] == LinearPath::kCublas && act_pad == 0)
        EXPECT_EQ(route.cublas_rows, m & ~7) << label << ": cuBLASLt did not take its rows: " << route.note;
      if (paths[pi] == LinearPath::kCublas && route.cublas_rows != (m & ~7))
        std::printf("    %s: cuBLASLt took %d rows: %s\n", label.c_str(), route.cublas_rows, route.note.c_str());
      if (paths[pi] == LinearPath::kSmallM) EXPECT_EQ(route.cublas_rows, 0) << label;
      EXPECT_TRUE(runs[0] == runs[1]) << label << ": two runs differ";
      expect_guard(label, runs[0], m, n, ldy, kPoison16);
      const std::vector<float> g = bf16_values(runs[0]);
      const std::vector<double> e = row_bounds(route, m, kECublasFp8);
      expect_close(label + " vs fp32 sum", g, ldy, c, n, s, m, n, 0x1p-8, 0.0, e);
      expect_close(label + " vs CPU twin", g, ldy, ycpu, n, s, m, n, 0x1p-8, 0x1p-8, sum_bounds(e, e));
      results[pi] = {true, g, route};
    }
    for (size_t i = 0; i < results.size(); ++i)
      for (size_t j = i + 1; j < results.size(); ++j)
        expect_close(at + " path " + std::to_string(i) + " vs " + std::to_string(j), results[i].y, ldy, results[j].y,
                     ldy, s, m, n, 0x1p-8, 0x1p-8,
                     sum_bounds(row_bounds(results[i].route, m, kECublasFp8), row_bounds(results[j].route, m, kECublasFp8)));
  }
}

std::vector<int> small_ms() {
  std::vector<int> ms;
  for (int m = 1; m <= 40; ++m) ms.push_back(m);
  for (int m : {64, 127, 128, 512}) ms.push_back(m);
  return ms;
}

class LinearCudaTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!have_cuda_device()) GTEST_SKIP() << "no CUDA device";
  }
};

TEST_F(LinearCudaTest, QuantizeActMatchesCpuBitForBit) {
  std::mt19937_64 rng(7);
  for (const auto& [m, k] : std::vector<std::pair<int, int64_t>>{{1, 128}, {5, 512}, {64, 4096}, {129, 1024}}) {
    std::vector<float> x = random_activation(m, k, rng);
    // Special blocks: all zero (floor scale), all tiny (below the 1e-4 floor), huge values.
    if (k >= 384) {
      for (int64_t c = 0; c < 128; ++c) x[size_t(c)] = 0.0f;
      for (int64_t c = 128; c < 256; ++c) x[size_t(c)] = round_bf16(float(c - 190) * 1e-7f);
      for (int64_t c = 256; c < 384; ++c) x[size_t(c)] = round_bf16(float(c - 300) * 1e30f);
    }
    const int64_t ldx = k + 8;
    DeviceArray<uint16_t> xd(to_bf16(rows_at_stride(x, m, k, ldx, k)));
    DeviceAct act(m, k);
    cuda::quantize_act(xd.get(), ldx, act.out(), nullptr);
    sync();
    expect_quantized("quantize_act m=" + std::to_string(m) + " k=" + std::to_string(k), x, k, m, k,
                     act.data->download(), act.ld, act.scales->download(), act.scale_ld);
  }
}

// Small stacked weight (256 + 200 rows: the last part not a multiple of 128;
// k = 384: three scale blocks, padded to four for cuBLASLt), both paths at
// every m.
TEST_F(LinearCudaTest, Fp8SmallShapesBothPaths) {
  std::mt19937_64 rng(11);
  std::vector<WeightMatrix> parts;
  parts.push_back(random_fp8("a", 256, 384, rng));
  parts.push_back(random_fp8("b", 200, 384, rng));
  check_fp8_linear("fp8 456x384", parts, small_ms(),
                   {LinearPath::kSmallM, LinearPath::kCublas, LinearPath::kAuto, LinearPath::kGemm}, 12);
}

TEST_F(LinearCudaTest, Fp8ThreeStackedParts) {
  std::mt19937_64 rng(13);
  std::vector<WeightMatrix> parts;
  parts.push_back(random_fp8("p0", 128, 1024, rng));
  parts.push_back(random_fp8("p1", 384, 1024, rng));
  parts.push_back(random_fp8("p2", 72, 1024, rng));
  const std::vector<LinearPath> paths = {LinearPath::kSmallM, LinearPath::kCublas, LinearPath::kGemm};
  check_fp8_linear("fp8 3 parts", parts, {1, 3, 8, 17, 64, 96, 200}, paths, 14);
  // Activation rows padded (ld = k + 16 and + 48): the own kernels, cuBLASLt where it takes them.
  check_fp8_linear("fp8 3 parts ld+16", parts, {5, 64, 96}, paths, 15, 16);
  check_fp8_linear("fp8 3 parts ld+48", parts, {9, 40}, paths, 16, 48);
}

// Different splits of k (1 up to one 128-block per CTA) agree within the bound.
TEST_F(LinearCudaTest, Fp8EverySplitOfK) {
  std::mt19937_64 rng(15);
  std::vector<WeightMatrix> parts;
  parts.push_back(random_fp8("w", 384, 1536, rng));
  for (int splits : {1, 2, 3, 4, 6, 12})
    check_fp8_linear("fp8 splits=" + std::to_string(splits), parts, {1, 8, 13, 64, 100},
                     {LinearPath::kSmallM, LinearPath::kGemm}, 16, 0, splits);
}

TEST_F(LinearCudaTest, Fp8FlashShapes) {
  std::mt19937_64 rng(17);
  const std::vector<int> ms = {1, 5, 8, 40, 64, 136, 515};
  const std::vector<LinearPath> auto_path = {LinearPath::kSmallM, LinearPath::kCublas, LinearPath::kAuto,
                                             LinearPath::kGemm};
  {
    std::vector<WeightMatrix> parts;  // wq_a + wkv
    parts.push_back(random_fp8("wq_a", 1024, 4096, rng));
    parts.push_back(random_fp8("wkv", 512, 4096, rng));
    check_fp8_linear("wq_a+wkv", parts, ms, auto_path, 18);
  }
  {
    std::vector<WeightMatrix> parts;
    parts.push_back(random_fp8("wq_b", 32768, 1024, rng));
    check_fp8_linear("wq_b", parts, ms, auto_path, 19);
  }
  {
    std::vector<WeightMatrix> parts;
    parts.push_back(random_fp8("wo_b", 4096, 8192, rng));
    check_fp8_linear("wo_b", parts, ms, auto_path, 20);
  }
  {
    std::vector<WeightMatrix> parts;
    parts.push_back(random_fp8("indexer.wq_b", 8192, 1024, rng));
    check_fp8_linear("indexer.wq_b", parts, {1, 8, 64, 128, 512},
                     {LinearPath::kSmallM, LinearPath::kCublas, LinearPath::kGemm}, 21);
  }
}

// wo_b's 32 row blocks at decode rows: where clusters of 8 do not all fit at
// once (the H200), the GEMM splits k 8 ways without a cluster and sums through the
// workspace (Fp8FlashShapes checks its values against the CPU at 1, 5 and 8
// rows); from 9 rows it keeps a cluster. Two runs give the same bits.
TEST_F(LinearCudaTest, Fp8GemmSumsDecodeSplitsThroughTheWorkspace) {
  int device = 0, sms = 0;
  ASSERT_EQ(cudaGetDevice(&device), cudaSuccess);
  ASSERT_EQ(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device), cudaSuccess);
  if (2 * sms < 256) GTEST_SKIP() << "needs 128 SMs for 256 CTAs two an SM, has " << sms;
  if (cuda::detail::gemm_resident_clusters(1, 8) >= 32)
    GTEST_SKIP() << "wo_b's 32 clusters of 8 all fit at once here: the GEMM keeps its cluster";
  std::mt19937_64 rng(23);
  const WeightMatrix w = random_fp8("wo_b", 4096, 8192, rng);
  Fp8Linear gpu(w, LinearOptions{LinearPath::kGemm, 32, 0});
  LinearWorkspace ws({gpu.needs(16)});
  for (int m : {1, 8, 16}) {
    const std::string at = "wo_b m=" + std::to_string(m);
    const DeviceAct act = quantized_on_gpu(random_activation(m, 8192, rng), m, 8192);
    std::vector<std::vector<uint16_t>> runs;
    for (int rep = 0; rep < 2; ++rep) {
      DeviceArray<uint16_t> y(std::vector<uint16_t>(size_t(m) * 4096, kPoison16));
      gpu.forward(Fp8Act(act.out()), y.get(), 4096, ws, nullptr);
      sync();
      runs.push_back(y.download());
    }
    const LinearRoute route = gpu.last_route();
    EXPECT_EQ(route.gemm_rows, m) << at;
    EXPECT_EQ(route.gemm_global_sum, m <= 8) << at;
    if (m <= 8) EXPECT_EQ(route.splits, 8) << at;
    EXPECT_TRUE(runs[0] == runs[1]) << at << ": two runs differ";
    for (uint16_t v : runs[0]) ASSERT_NE(v, kPoison16) << at << ": an output was not written";
  }
}

// cuBLASLt's block-scaled FP8 algorithm for wq_a+wkv (12 tiles of 128 x 128
// at up to 128 rows, k = 4096) runs on a tenth of the SMs unless k is split;
// the plan splits it where the tiles fill at most an eighth of the GPU
// (Fp8FlashShapes checks the values of such rows against the CPU: m = 40,
// 64), and not for indexer.wq_b (64 tiles). Two runs of a split plan give
// the same bits.
TEST_F(LinearCudaTest, Fp8CublasSplitsKWhereFewTilesFillTheGpu) {
  int dev = 0, sms = 0;
  ASSERT_EQ(cudaGetDevice(&dev), cudaSuccess);
  ASSERT_EQ(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev), cudaSuccess);
  std::mt19937_64 rng(29);
  const WeightMatrix wqkv = random_fp8("wq_a+wkv", 1536, 4096, rng), idx = random_fp8("indexer.wq_b", 8192, 1024, rng);
  for (const auto& [w, m, split] : std::vector<std::tuple<const WeightMatrix*, int, bool>>{
           {&wqkv, 16, sms >= 96}, {&wqkv, 64, sms >= 96}, {&wqkv, 128, sms >= 96}, {&idx, 64, false}}) {
    const std::string at = w->name + " m=" + std::to_string(m);
    Fp8Linear gpu(*w, LinearOptions{LinearPath::kCublas});
    const int64_t n = gpu.out_features(), k = gpu.in_features();
    LinearWorkspace ws({gpu.needs(m)});
    const DeviceAct act = quantized_on_gpu(random_activation(m, k, rng), m, k, 16);
    std::vector<std::vector<uint16_t>> runs;
    for (int rep = 0; rep < 2; ++rep) {
      DeviceArray<uint16_t> y(std::vector<uint16_t>(size_t(m) * size_t(n), kPoison16));
      gpu.forward(Fp8Act(act.out()), y.get(), n, ws, nullptr);
      sync();
      runs.push_back(y.download());
    }
    const LinearRoute route = gpu.last_route();
    EXPECT_EQ(route.cublas_rows, m) << at << ": " << route.note;
    if (split)
      EXPECT_GT(route.cublas_splits, 1) << at << " on " << sms << " SMs";
    else
      EXPECT_EQ(route.cublas_splits, 1) << at;
    EXPECT_TRUE(runs[0] == runs[1]) << at << ": two runs differ";
  }
}

// A random activation of m rows, quantized on the GPU, and the output of
// `gpu` on it under options o (the routing tests).
struct RoutedInput {
  int m;
  DeviceAct act;
  RoutedInput(int m_, int64_t k, std::mt19937_64& rng) : m(m_), act(quantized_on_gpu(random_activation(m_, k, rng), m_, k, 16)) {}
  std::vector<uint16_t> run(Fp8Linear& gpu, const LinearOptions& o, LinearWorkspace& ws) const {
    gpu.set_options(o);
    const int64_t n = gpu.out_features();
    DeviceArray<uint16_t> y(std::vector<uint16_t>(size_t(m) * size_t(n), kPoison16));
    gpu.forward(Fp8Act(act.out()), y.get(), n, ws, nullptr);
    sync();
    return y.download();
  }
};

// cublas_from: row counts from it that are multiples of 8 go to cuBLASLt
// whole, below small_m_max too; the others stay on the own kernel (no second
// pass over the weight for a remainder). Each output is the bits of the
// path that took its rows.
TEST_F(LinearCudaTest, Fp8CublasFromTakesWholeMultiplesOf8) {
  std::mt19937_64 rng(23);
  const WeightMatrix w = random_fp8("w", 256, 1024, rng);
  Fp8Linear gpu(w);
  const int64_t k = gpu.in_features();
  LinearWorkspace ws({gpu.needs(40)});
  // m, rows cuBLASLt takes with cublas_from = 16 and small_m_max = 32
  for (const auto& [m, lt_rows] : std::vector<std::pair<int, int>>{
           {8, 0}, {12, 0}, {15, 0}, {16, 16}, {20, 0}, {24, 24}, {31, 0}, {32, 32}, {33, 32}, {40, 40}}) {
    const std::string at = "m=" + std::to_string(m);
    const RoutedInput in(m, k, rng);
    auto run = [&](const LinearOptions& o) { return in.run(gpu, o, ws); };
    LinearOptions from16;
    from16.cublas_from = 16;
    const std::vector<uint16_t> y = run(from16);
    const LinearRoute route = gpu.last_route();
    EXPECT_EQ(route.cublas_rows, lt_rows) << at << ": " << route.note;
    EXPECT_EQ(route.kernel_rows, m - lt_rows) << at;
    LinearOptions same_path;  // the path that should have run, alone
    same_path.path = lt_rows == m ? LinearPath::kCublas : (lt_rows == 0 ? LinearPath::kSmallM : LinearPath::kAuto);
    EXPECT_TRUE(y == run(same_path)) << at << ": not the bits of the path that took the rows";
  }
}

// gemm_from, gemm_max: row counts between them go to the FP8 GEMM whole,
// before small_m_max and cublas_from; fewer stay on the small-M kernel, more
// go to cuBLASLt. Each output is the bits of the path that took its rows, and the
// q-head tail is fused on up to 8 rows of the GEMM or the small-M kernel.
TEST_F(LinearCudaTest, Fp8GemmFromTakesItsRows) {
  std::mt19937_64 rng(31);
  const WeightMatrix w = random_fp8("w", 512, 1024, rng);
  Fp8Linear gpu(w);
  const int64_t k = gpu.in_features();
  LinearOptions from8;
  from8.gemm_from = 8;
  from8.gemm_max = 64;
  from8.cublas_from = 16;
  LinearWorkspace ws({gpu.needs(136)});
  // m, the path that should take all rows
  for (const auto& [m, path] : std::vector<std::pair<int, LinearPath>>{{1, LinearPath::kSmallM},
                                                                       {7, LinearPath::kSmallM},
                                                                       {8, LinearPath::kGemm},
                                                                       {16, LinearPath::kGemm},
                                                                       {33, LinearPath::kGemm},
                                                                       {64, LinearPath::kGemm},
                                                                       {72, LinearPath::kCublas},
                                                                       {136, LinearPath::kCublas}}) {
    const std::string at = "m=" + std::to_string(m);
    const RoutedInput in(m, k, rng);
    auto run = [&](const LinearOptions& o) { return in.run(gpu, o, ws); };
    const std::vector<uint16_t> y = run(from8);
    const LinearRoute route = gpu.last_route();
    EXPECT_EQ(route.gemm_rows, path == LinearPath::kGemm ? m : 0) << at;
    EXPECT_EQ(route.cublas_rows, path == LinearPath::kCublas ? m : 0) << at << ": " << route.note;
    EXPECT_EQ(route.kernel_rows, path == LinearPath::kSmallM ? m : 0) << at;
    gpu.set_options(from8);
    const cuda::QHeadNormRopeParams heads{};
    const cuda::ResidualNormParams norm{};
    EXPECT_EQ(gpu.fuses({.q_head = &heads}, m), m <= 8 && path != LinearPath::kCublas) << at << ": 512 columns are one head";
    EXPECT_EQ(gpu.fuses({.residual = &norm}, m), m <= 8 && path != LinearPath::kCublas) << at;
    EXPECT_FALSE(gpu.fuses({}, m)) << at << ": no tail asked for";
    EXPECT_TRUE(y == run({path})) << at << ": not the bits of the path that took the rows";
  }
}

// ---- wo_a ---------------------------------------------------------------------------

// Runs wo_a (G groups of [n_g, k_g]) at every m on each variant: y against
// the CPU twin (per group, bf16 product; FP8 product for fp8_input), the FP8
// output against the CPU quantizer applied to the GPU's y.
void check_w8a16(const std::string& name, int groups, int64_t n_g, int64_t k_g, const std::vector<int>& ms,
                 uint64_t seed, int splits = 0, bool gemm_only = false) {
  std::mt19937_64 rng(seed);
  const WeightMatrix wm = random_fp8("wo_a", groups * n_g, k_g, rng);
  W8A16GroupedLinear gpu(wm, groups);
  const int max_m = *std::max_element(ms.begin(), ms.end());
  W8A16Options split_opts;
  split_opts.splits = splits;  // a forced split can need more partials than the automatic one
  W8A16Options fp8_opts = split_opts;
  fp8_opts.fp8_input = true;
  gpu.set_options(fp8_opts);
  const cuda::LinearNeeds fp8_needs = gpu.needs(max_m);  // the FP8 GEMM needs no more
  gpu.set_options(split_opts);
  LinearWorkspace ws({gpu.needs(max_m), fp8_needs});
  std::vector<Linear> cpu_bf16, cpu_fp8;
  for (int g = 0; g < groups; ++g) {
    cpu_bf16.emplace_back(&wm, LinearMode::kBf16, true, g * n_g, n_g);
    cpu_fp8.emplace_back(&wm, LinearMode::kFp8, true, g * n_g, n_g);
  }
  const std::vector<float> w = wm.dequantize(), aw = absolute(w);
  const int64_t kin = groups * k_g, nout = groups * n_g, ldx = kin + 8, ldy = nout + 8;

  struct Variant {
    const char* label;
    LinearPath path;
    bool fp8_input;
  };
  const Variant variants[] = {{"own", LinearPath::kSmallM, false},
                              {"cublas", LinearPath::kCublas, false},
                              {"fp8_input own", LinearPath::kSmallM, true},
                              {"fp8_input cublas", LinearPath::kCublas, true},
                              {"fp8_input gemm", LinearPath::kGemm, true},
                              {"gemm", LinearPath::kGemm, false}};
  const std::span<const Variant> run = gemm_only ? std::span<const Variant>(variants).last(1) : variants;
  for (int m : ms) {
    const std::string at = name + " m=" + std::to_string(m);
    const std::vector<float> x = random_activation(m, kin, rng);
    DeviceArray<uint16_t> xd(to_bf16(rows_at_stride(x, m, kin, ldx, kin)));
    const std::vector<float> xq = fake_quantized(x);
    // References per group: the bf16 product and the FP8 variant's product.
    std::vector<float> c(size_t(m) * size_t(nout)), s(c.size()), cq(c.size()), sq(c.size()), ycpu(c.size()),
        ycpu_q(c.size());
    for (int g = 0; g < groups; ++g) {
      const float *wg = w.data() + g * n_g * k_g, *ag = aw.data() + g * n_g * k_g;
      reference(x.data() + g * k_g, kin, m, wg, ag, n_g, k_g, c.data() + g * n_g, s.data() + g * n_g, nout);
      reference(xq.data() + g * k_g, kin, m, wg, ag, n_g, k_g, cq.data() + g * n_g, sq.data() + g * n_g, nout);
      cpu_bf16[size_t(g)].forward(x.data() + g * k_g, int(kin), m, ycpu.data() + g * n_g, int(nout),
                                  Profile::kProduction);
      cpu_fp8[size_t(g)].forward(x.data() + g * k_g, int(kin), m, ycpu_q.data() + g * n_g, int(nout),
                                 Profile::kProduction);
    }
    std::vector<float> own_y;
    LinearRoute own_route;
    for (const Variant& v : run) {
      W8A16Options opts;
      opts.path = v.path;
      opts.fp8_input = v.fp8_input;
      opts.splits = splits;
      gpu.set_options(opts);
      const std::string label = at + " " + v.label + (splits ? " splits " + std::to_string(splits) : "");
      std::vector<std::vector<uint16_t>> runs;
      std::vector<uint8_t> q;
      std::vector<float> qs;
      DeviceAct qd(m, nout);
      for (int rep = 0; rep < 2; ++rep) {
        DeviceArray<uint16_t> y(std::vector<uint16_t>(size_t((m + 2) * ldy), kPoison16));
        const Fp8ActOut qo = qd.out();
        gpu.forward(xd.get(), ldx, m, y.get(), ldy, &qo, ws, nullptr);
        sync();
        runs.push_back(y.download());
        if (rep == 0) q = qd.data->download(), qs = qd.scales->download();
      }
      const LinearRoute route = gpu.last_route();
      const int want_cublas = v.path != LinearPath::kCublas ? 0 : (v.fp8_input ? (m & ~7) : m);
      EXPECT_EQ(route.cublas_rows, want_cublas) << label << ": " << route.note;
      EXPECT_EQ(route.gemm_rows, v.path == LinearPath::kGemm ? m : 0) << label;
      EXPECT_TRUE(runs[0] == runs[1]) << label << ": two runs differ";
      expect_guard(label, runs[0], m, nout, ldy, kPoison16);
      const std::vector<float> g = bf16_values(runs[0]);
      const std::vector<double> e = row_bounds(route, m, v.fp8_input ? kECublasFp8 : kECublasBf16);
      if (v.fp8_input) {
        expect_close(label + " vs fp32 sum", g, ldy, cq, nout, sq, m, nout, 0x1p-8, 0.0, e);
        expect_close(label + " vs CPU twin", g, ldy, ycpu_q, nout, sq, m, nout, 0x1p-8, 0x1p-8, sum_bounds(e, e));
      } else {
        expect_close(label + " vs fp32 sum", g, ldy, c, nout, s, m, nout, 0x1p-8, 0.0, e);
        expect_close(label + " vs CPU twin", g, ldy, ycpu, nout, s, m, nout, 0x1p-8, 0x1p-8, sum_bounds(e, e));
      }
      expect_quantized(label + " FP8 output", g, ldy, m, nout, q, qd.ld, qs, qd.scale_ld);
      if (splits > 0 && v.path == LinearPath::kGemm) EXPECT_EQ(route.splits, splits) << label;
      if (v.path == LinearPath::kGemm && !v.fp8_input)
        EXPECT_FALSE(route.quantize_kernel) << label << ": the quantization should be fused";
      if (v.path == LinearPath::kSmallM && !v.fp8_input) {
        EXPECT_FALSE(route.quantize_kernel) << label << ": the quantization should be fused";
        own_y = g, own_route = route;
      }
      if (v.path == LinearPath::kCublas && !v.fp8_input)
        expect_close(label + " vs own", g, ldy, own_y, ldy, s, m, nout, 0x1p-8, 0x1p-8,
                     sum_bounds(e, row_bounds(own_route, m, kECublasBf16)));
    }
  }
}

// ---- the q-head tail (wq_b's decode path) ----------------------------------------------

// Fp8Linear with a q-head tail must give, bit for bit, the linear followed
// by q_head_norm_rope_cuda: at 1..8 rows, on the small-M kernel and the GEMM
// (opts.path), with the automatic and a forced split of k (then the heads'
// last CTAs are split-K reducers, or the GEMM's clusters write a head),
// twice in a row (the arrival counters reset). At 9 rows forward() declines
// and the caller runs the op. Without the tail the result is the plain
// linear, which the norm changes everywhere, so a tail that did not run
// cannot pass.
void check_q_head_tail(int heads, int64_t k, const LinearOptions& opts, uint64_t seed) {
  std::mt19937_64 rng(seed);
  const std::vector<WeightMatrix> parts = {random_fp8("wq_b", int64_t(heads) * 512, k, rng)};
  Fp8Linear gpu(pointers(parts), opts);
  const int64_t n = gpu.out_features();
  LinearWorkspace ws({gpu.needs(9)});
  const Rope rope(RopeParams{10000, false, YarnParams{}});
  for (int m : {1, 3, 8, 9}) {
    const std::string at = "heads " + std::to_string(heads) + " k " + std::to_string(k) + " m " + std::to_string(m);
    const DeviceAct act = quantized_on_gpu(random_activation(m, k, rng), m, k);
    std::vector<int32_t> pos(static_cast<size_t>(m));
    for (int32_t& p : pos) p = int32_t(rng() % 1048576);
    pos[0] = 1048575;
    DeviceArray<int32_t> dpos(pos);
    DeviceArray<uint16_t> want(std::vector<uint16_t>(size_t(m) * size_t(n), kPoison16));
    DeviceArray<uint16_t> got(std::vector<uint16_t>(size_t(m) * size_t(n), kPoison16));
    const cuda::QHeadNormRopeParams qw{m, heads, want.get(), n, 1e-6f, dpos.get(), &rope};
    EXPECT_FALSE(gpu.forward(Fp8Act(act.out()), want.get(), n, ws, nullptr)) << at;
    sync();
    const std::vector<uint16_t> plain = want.download();
    cuda::q_head_norm_rope_cuda(qw, nullptr);
    sync();
    const std::vector<uint16_t> ref = want.download();
    size_t normed = 0;
    for (size_t i = 0; i < ref.size(); ++i) normed += ref[i] != plain[i];
    EXPECT_GT(normed, ref.size() / 2) << at << ": the norm changed too little to test anything";
    cuda::QHeadNormRopeParams qg = qw;
    qg.q = got.get();
    for (int rep = 0; rep < 2; ++rep) {
      const bool fused = gpu.forward(Fp8Act(act.out()), got.get(), n, ws, nullptr, {.q_head = &qg});
      EXPECT_EQ(fused, m <= 8) << at;
      if (opts.path == LinearPath::kGemm) EXPECT_EQ(gpu.last_route().gemm_rows, m) << at;
      if (!fused) cuda::q_head_norm_rope_cuda(qg, nullptr);
      sync();
      const std::vector<uint16_t> g = got.download();
      size_t first = g.size();
      for (size_t i = 0; i < g.size() && first == g.size(); ++i)
        if (g[i] != ref[i]) first = i;
      EXPECT_EQ(first, g.size()) << at << " rep " << rep << ": first difference at row " << first / size_t(n)
                                 << ", head " << first % size_t(n) / 512 << ", dim " << first % 512;
    }
  }
}

TEST_F(LinearCudaTest, QHeadTailMatchesTheSeparateOp) {
  check_q_head_tail(4, 256, {LinearPath::kAuto, 32, 0}, 81);
  check_q_head_tail(4, 1024, {LinearPath::kAuto, 32, 2}, 82);   // split-K
  check_q_head_tail(64, 1024, {LinearPath::kAuto, 32, 0}, 83);  // Flash's wq_b
}

// The same on the wgmma GEMM (small shapes, for compute-sanitizer), then at
// Flash's wq_b.
TEST_F(LinearCudaTest, QHeadTailOnTheGemmMatchesTheSeparateOp) {
  check_q_head_tail(4, 1024, {LinearPath::kGemm, 32, 0}, 84);
  check_q_head_tail(4, 1024, {LinearPath::kGemm, 32, 2}, 85);  // clusters of 2
  check_q_head_tail(8, 2048, {LinearPath::kGemm, 32, 4}, 86);  // clusters of 4
}

TEST_F(LinearCudaTest, QHeadTailOnTheGemmFlashShape) { check_q_head_tail(64, 1024, {LinearPath::kGemm, 32, 0}, 87); }

// ---- the residual tail (wo_b's decode path) ---------------------------------------------

// Where a residual_norm writes, filled the same way for the reference and the
// fused run: h from h0, y and x poisoned, the FP8 x poisoned.
struct ResidualOut {
  DeviceArray<float> h;
  DeviceArray<uint16_t> y, x;
  DeviceAct x8;
  ResidualOut(const std::vector<float>& h0, int m, int64_t n)
      : h(h0), y(std::vector<uint16_t>(size_t(m) * size_t(n), kPoison16)),
        x(std::vector<uint16_t>(size_t(m) * size_t(n), kPoison16)), x8(m, n, m, 0) {}
  cuda::ResidualNormParams params(int m, int64_t n, const int* real) const {
    cuda::ResidualNormParams r;
    r.mode = cuda::ResidualMode::kAddNorm;
    r.num_tokens = m;
    r.num_real_tokens = real;
    r.dim = int(n);
    r.h = h.get(), r.h_ld = n;
    r.y = y.get(), r.y_ld = n;
    r.eps = 1e-6f;
    r.x = x.get(), r.x_ld = n;
    r.x_fp8 = x8.out();
    return r;
  }
};

// Fp8Linear with a residual tail must give, bit for bit, the linear followed
// by residual_norm_cuda (h += y, then x = RMSNorm(h) as bf16 and FP8): at
// 1..8 rows (past one row the last is padding: its h stays, its x is zeros),
// on the path and split the options ask for, twice in a row (the arrival
// counter resets). At 9 rows forward() declines and the caller runs the op.
// A tail that did not run leaves h as it was and x poisoned (NaN), so it
// cannot pass. global_sum: whether the GEMM's splits must have been summed
// through the workspace (else in a cluster or not split); resident: whether
// every CTA that writes outputs fits at once (else the tail, whose barrier
// waits for all of them, must be declined); cluster_sum: whether the small-M
// kernel's splits must have been summed in a cluster (else through the
// workspace or not split).
void check_residual_tail(int64_t n, int64_t k, const LinearOptions& opts, uint64_t seed, bool global_sum = false,
                         bool resident = true, bool cluster_sum = false) {
  std::mt19937_64 rng(seed);
  const std::vector<WeightMatrix> parts = {random_fp8("wo_b", n, k, rng)};
  Fp8Linear gpu(pointers(parts), opts);
  LinearWorkspace ws({gpu.needs(9)});
  for (int m : {1, 3, 8, 9}) {
    const std::string at = "n " + std::to_string(n) + " k " + std::to_string(k) + " m " + std::to_string(m);
    const DeviceAct act = quantized_on_gpu(random_activation(m, k, rng), m, k);
    const std::vector<float> h0 = random_activation(m, n, rng);
    DeviceArray<int> real(std::vector<int>{m > 1 ? m - 1 : m});
    ResidualOut want(h0, m, n);
    EXPECT_FALSE(gpu.forward(Fp8Act(act.out()), want.y.get(), n, ws, nullptr)) << at;
    cuda::residual_norm_cuda(want.params(m, n, real.get()), nullptr);
    sync();
    const std::vector<float> h_want = want.h.download();
    size_t changed = 0;
    for (size_t i = 0; i < h0.size(); ++i) changed += h_want[i] != h0[i];
    EXPECT_GT(changed, h0.size() / 2) << at << ": the add changed too little to test anything";
    for (int rep = 0; rep < 2; ++rep) {
      ResidualOut got(h0, m, n);
      const cuda::ResidualNormParams r = got.params(m, n, real.get());
      const bool fused = gpu.forward(Fp8Act(act.out()), got.y.get(), n, ws, nullptr, {.residual = &r});
      EXPECT_EQ(fused, m <= 8 && resident) << at;
      const LinearRoute route = gpu.last_route();
      if (opts.path == LinearPath::kGemm) {
        EXPECT_EQ(route.gemm_rows, m) << at;
        if (fused) EXPECT_EQ(route.gemm_global_sum, global_sum) << at << ": not the reduce path the case is for";
      } else if (fused) {
        EXPECT_EQ(route.kernel_rows, m) << at;
        EXPECT_EQ(route.kernel_cluster_sum, cluster_sum) << at << ": not the reduce path the case is for";
      }
      if (!fused) cuda::residual_norm_cuda(r, nullptr);
      sync();
      const std::string where = at + " rep " + std::to_string(rep);
      EXPECT_TRUE(got.y.download() == want.y.download()) << where << ": y";
      EXPECT_TRUE(got.h.download() == h_want) << where << ": h";
      EXPECT_TRUE(got.x.download() == want.x.download()) << where << ": x";
      EXPECT_TRUE(got.x8.data->download() == want.x8.data->download()) << where << ": the FP8 x";
      const std::vector<float> sg = got.x8.scales->download(), sw = want.x8.scales->download();  // poison: NaN
      EXPECT_EQ(std::memcmp(sg.data(), sw.data(), sg.size() * sizeof(float)), 0) << where << ": the FP8 x's scales";
    }
  }
}

TEST_F(LinearCudaTest, ResidualTailMatchesTheSeparateOp) {
  check_residual_tail(512, 256, {LinearPath::kSmallM, 32, 1}, 91);                     // not split
  check_residual_tail(512, 1024, {LinearPath::kSmallM, 32, 4}, 92, false, true, true);  // a cluster of 4 splits
  check_residual_tail(384, 768, {LinearPath::kSmallM, 32, 3}, 93);   // 3 splits: the workspace sum
  check_residual_tail(1024, 512, {LinearPath::kGemm, 32, 0}, 94);    // no split
  check_residual_tail(1024, 2048, {LinearPath::kGemm, 32, 4}, 95);   // clusters of 4
}

// Flash's wo_b on the GEMM's automatic split: 8 splits summed through the
// workspace at decode rows.
// Then a forced split of 8 in clusters: the tail only where its 32 clusters
// all fit at once.
TEST_F(LinearCudaTest, ResidualTailFlashShape) {
  check_residual_tail(4096, 8192, {LinearPath::kGemm, 32, 0}, 96, true);
  const bool fit = 4096 / 128 <= cuda::detail::gemm_resident_clusters(1, 8);
  std::printf("    32 clusters of 8 resident at once: %s\n", fit ? "yes" : "no");
  check_residual_tail(4096, 8192, {LinearPath::kGemm, 32, 8}, 97, false, fit);
}

TEST_F(LinearCudaTest, W8A16SmallShapesAllVariants) {
  check_w8a16("wo_a 4x[128,256]", 4, 128, 256, small_ms(), 31);
  check_w8a16("wo_a 2x[256,384]", 2, 256, 384, {1, 7, 8, 33, 64, 65, 130}, 32);
}

// The `small` preset's shapes (hidden 1024, q_lora 256, 4 groups of 256 x 2048):
// the engine's GPU-vs-CPU test runs them.
TEST_F(LinearCudaTest, SmallPresetShapes) {
  std::mt19937_64 rng(41);
  const std::vector<int> ms = {1, 3, 8, 17, 40, 300};
  const std::vector<LinearPath> paths = {LinearPath::kSmallM, LinearPath::kCublas, LinearPath::kAuto};
  {
    std::vector<WeightMatrix> parts;
    parts.push_back(random_fp8("wq_a", 256, 1024, rng));
    parts.push_back(random_fp8("wkv", 512, 1024, rng));
    check_fp8_linear("small wq_a+wkv", parts, ms, paths, 42);
  }
  {
    std::vector<WeightMatrix> parts;
    parts.push_back(random_fp8("wq_b", 16 * 512, 256, rng));
    check_fp8_linear("small wq_b", parts, ms, paths, 43);
  }
  {
    std::vector<WeightMatrix> parts;
    parts.push_back(random_fp8("wo_b", 1024, 1024, rng));
    check_fp8_linear("small wo_b", parts, ms, paths, 44);
  }
  check_w8a16("small wo_a 4x[256,2048]", 4, 256, 2048, ms, 45);
}

// The wgmma GEMM's split of k over a cluster (and the small-M kernel's,
// forced the same): 16 k blocks a group, so 1, 2, 4 and 8 splits all apply.
TEST_F(LinearCudaTest, W8A16EverySplitOfK) {
  for (int splits : {1, 2, 4, 8})
    check_w8a16("wo_a 2x[256,2048]", 2, 256, 2048, {1, 5, 8, 16, 32, 64, 100}, 34 + uint64_t(splits), splits);
}

// The FP8 x bf16 GEMM alone (no cuBLASLt call in the process: racecheck
// stops on one of cuBLASLt's kernels, docs/perf-notes.md run Y3), split 2.
TEST_F(LinearCudaTest, W8A16GemmAlone) {
  check_w8a16("wo_a 2x[256,2048]", 2, 256, 2048, {1, 16, 32, 64, 128}, 40, 2, true);
}

TEST_F(LinearCudaTest, W8A16FlashShape) { check_w8a16("wo_a 8x[1024,4096]", 8, 1024, 4096, {1, 8, 64, 128, 512}, 33); }

// ---- decode rows' split sums ---------------------------------------------------------

// A row's products do not depend on the other rows, and every cluster sum
// adds the splits in rank order, so 1-8 rows (one 8-token tile) give bit for
// bit the first rows of the same call at 9 rows (a 16-token tile), y and
// wo_a's FP8 output alike, on both own kernels and at 2, 4 and 8 splits.
// A decode-only way of summing the splits (docs/experiments/push-sum.patch:
// pushed to each row's owner instead of pulled) must keep this.
struct SplitRun {
  std::vector<uint16_t> y;
  std::vector<uint8_t> q;  // W8A16 only
  LinearRoute route;
};

void expect_rows_equal(const std::string& label, const SplitRun& few, const SplitRun& nine, int m, int64_t ny,
                       int64_t ldy, int64_t nq, int64_t ldq) {
  for (int r = 0; r < m; ++r) {
    EXPECT_EQ(std::memcmp(few.y.data() + r * ldy, nine.y.data() + r * ldy, size_t(ny) * 2), 0) << label << " y row " << r;
    if (nq > 0)
      EXPECT_EQ(std::memcmp(few.q.data() + r * ldq, nine.q.data() + r * ldq, size_t(nq)), 0) << label << " q row " << r;
  }
}

TEST_F(LinearCudaTest, DecodeTileGivesTheBitsOfALongerTile) {
  std::mt19937_64 rng(97);
  const int groups = 2;
  const int64_t n_g = 256, k_g = 2048;  // 16 k blocks a group: 2, 4 and 8 splits
  const WeightMatrix wa = random_fp8("wo_a", groups * n_g, k_g, rng);
  W8A16GroupedLinear w8(wa, groups);
  std::vector<WeightMatrix> parts;
  parts.push_back(random_fp8("w", 384, k_g, rng));
  Fp8Linear f8(pointers(parts));
  std::vector<cuda::LinearNeeds> needs;  // forced splits can need more partials than the automatic ones
  for (LinearPath path : {LinearPath::kSmallM, LinearPath::kGemm}) {
    W8A16Options opts;
    opts.path = path, opts.splits = 8;
    w8.set_options(opts);
    f8.set_options({path, 32, 8});
    needs.push_back(w8.needs(9));
    needs.push_back(f8.needs(9));
  }
  LinearWorkspace ws(needs);
  const int64_t kin = groups * k_g, ldx = kin + 8, nout = groups * n_g, ldy = nout + 8;
  const std::vector<float> x = random_activation(9, kin, rng);
  DeviceArray<uint16_t> xd(to_bf16(rows_at_stride(x, 9, kin, ldx, kin)));
  // The FP8 linear's input: each row's first k_g columns.
  const std::vector<float> x8 = rows_at_stride(x, 9, kin, k_g, k_g);
  const DeviceAct act = quantized_on_gpu(x8, 9, k_g);

  auto run_w8 = [&](int m, LinearPath path, int splits) {
    W8A16Options opts;
    opts.path = path, opts.splits = splits;
    w8.set_options(opts);
    DeviceArray<uint16_t> y(std::vector<uint16_t>(size_t((m + 2) * ldy), kPoison16));
    DeviceAct qd(m, nout);
    const Fp8ActOut qo = qd.out();
    w8.forward(xd.get(), ldx, m, y.get(), ldy, &qo, ws, nullptr);
    sync();
    return SplitRun{y.download(), qd.data->download(), w8.last_route()};
  };
  auto run_f8 = [&](int m, LinearPath path, int splits) {
    f8.set_options({path, 32, splits});
    DeviceArray<uint16_t> y(std::vector<uint16_t>(size_t((m + 2) * ldy), kPoison16));
    Fp8ActOut in = act.out();
    in.rows = m;
    f8.forward(Fp8Act(in), y.get(), ldy, ws, nullptr);
    sync();
    return SplitRun{y.download(), {}, f8.last_route()};
  };
  for (LinearPath path : {LinearPath::kSmallM, LinearPath::kGemm})
    for (int splits : {2, 4, 8}) {
      const std::string at = path_name(path) + " splits " + std::to_string(splits);
      const SplitRun w9 = run_w8(9, path, splits), f9 = run_f8(9, path, splits);
      for (const SplitRun* r : {&w9, &f9}) {
        ASSERT_EQ(r->route.splits, splits) << at;
        if (path == LinearPath::kSmallM) EXPECT_TRUE(r->route.kernel_cluster_sum) << at << ": not in a cluster";
        if (path == LinearPath::kGemm) EXPECT_FALSE(r->route.gemm_global_sum) << at << ": not in a cluster";
      }
      for (int m = 1; m <= 8; ++m) {
        const std::string label = at + " m=" + std::to_string(m);
        const SplitRun w = run_w8(m, path, splits), f = run_f8(m, path, splits);
        for (const SplitRun* r : {&w, &f}) {  // the same sums as at 9 rows: in a cluster
          EXPECT_EQ(r->route.kernel_cluster_sum, path == LinearPath::kSmallM) << label;
          EXPECT_FALSE(r->route.gemm_global_sum) << label;
        }
        expect_guard(label + " wo_a", w.y, m, nout, ldy, kPoison16);
        expect_rows_equal(label + " wo_a", w, w9, m, nout, ldy, nout, nout + 16);
        expect_rows_equal(label + " fp8", f, f9, m, 384, ldy, 0, 0);
      }
    }
}

// ---- bf16 stack, fp32 output -------------------------------------------------------

void check_bf16_linear(const std::string& name, const std::vector<WeightMatrix>& parts, const std::vector<int>& ms,
                       uint64_t seed) {
  std::mt19937_64 rng(seed);
  const std::vector<const WeightMatrix*> ptrs = pointers(parts);
  Bf16Linear gpu(ptrs);
  const int64_t n = gpu.out_features(), k = gpu.in_features();
  const int max_m = *std::max_element(ms.begin(), ms.end());
  LinearWorkspace ws({gpu.needs(max_m)});
  std::vector<Linear> cpu_f32, cpu_bf16;
  for (const WeightMatrix& w : parts) {
    cpu_f32.emplace_back(&w, LinearMode::kF32, true);
    cpu_bf16.emplace_back(&w, LinearMode::kBf16, true);
  }
  const std::vector<float> w = dequantized(parts), aw = absolute(w);
  const int64_t ldx = k + 8, ldy = n + 4;
  for (int m : ms) {
    const std::string at = name + " m=" + std::to_string(m);
    const std::vector<float> x = random_activation(m, k, rng);
    DeviceArray<uint16_t> xd(to_bf16(rows_at_stride(x, m, k, ldx, k)));
    std::vector<float> c(size_t(m) * size_t(n)), s(c.size()), y32(c.size()), y16(c.size());
    reference(x.data(), k, m, w.data(), aw.data(), n, k, c.data(), s.data(), n);
    int64_t col = 0;
    for (size_t p = 0; p < parts.size(); ++p) {
      cpu_f32[p].forward(x.data(), int(k), m, y32.data() + col, int(n), Profile::kProduction);
      cpu_bf16[p].forward(x.data(), int(k), m, y16.data() + col, int(n), Profile::kProduction);
      col += parts[p].rows;
    }
    std::vector<float> prev;
    LinearRoute prev_route;
    for (LinearPath path : {LinearPath::kSmallM, LinearPath::kCublas}) {
      gpu.set_options({path, 32});
      const std::string label = at + (path == LinearPath::kCublas ? " cublas" : " own");
      std::vector<std::vector<float>> runs;
      for (int rep = 0; rep < 2; ++rep) {
        DeviceArray<float> y(std::vector<float>(size_t((m + 2) * ldy), poison_f32()));
        gpu.forward(xd.get(), ldx, m, y.get(), ldy, ws, nullptr);
        sync();
        runs.push_back(y.download());
      }
      const LinearRoute route = gpu.last_route();
      EXPECT_EQ(route.cublas_rows, path == LinearPath::kCublas ? m : 0) << label << ": " << route.note;
      EXPECT_EQ(std::memcmp(runs[0].data(), runs[1].data(), runs[0].size() * 4), 0) << label << ": two runs differ";
      std::vector<uint32_t> bits(runs[0].size());
      std::memcpy(bits.data(), runs[0].data(), bits.size() * 4);
      expect_guard(label, bits, m, n, ldy, kPoison32);
      const std::vector<double> e = row_bounds(route, m, kECublasBf16);
      expect_close(label + " vs fp32 sum", runs[0], ldy, c, n, s, m, n, 0.0, 0.0, e);
      expect_close(label + " vs CPU twin (f32)", runs[0], ldy, y32, n, s, m, n, 0.0, 0.0, sum_bounds(e, e));
      std::vector<float> rounded(runs[0]);
      for (float& v : rounded) v = round_bf16(v);
      expect_close(label + " rounded vs CPU twin (bf16)", rounded, ldy, y16, n, s, m, n, 0x1p-8, 0x1p-8,
                   sum_bounds(e, e));
      if (!prev.empty())
        expect_close(label + " vs own", runs[0], ldy, prev, ldy, s, m, n, 0.0, 0.0,
                     sum_bounds(e, row_bounds(prev_route, m, kECublasBf16)));
      prev = runs[0], prev_route = route;
    }
  }
}

TEST_F(LinearCudaTest, Bf16SmallShapesBothPaths) {
  std::mt19937_64 rng(41);
  std::vector<WeightMatrix> parts;
  parts.push_back(random_bf16("wkv", 128, 256, rng));
  parts.push_back(random_bf16("wgate", 64, 256, rng));
  parts.push_back(random_bf16("weights_proj", 40, 256, rng));
  check_bf16_linear("bf16 232x256", parts, small_ms(), 42);
}

TEST_F(LinearCudaTest, Bf16AcceptsFp8AndF32Parts) {
  std::mt19937_64 rng(43);
  std::vector<WeightMatrix> parts;
  parts.push_back(random_fp8("fp8 part", 136, 384, rng));  // dequantized exactly at upload
  WeightMatrix f32;
  f32.name = "f32 part";
  f32.rows = 24, f32.cols = 384, f32.dtype = DType::kF32;
  std::vector<float> v = random_weight_values(24, 384, rng);
  for (float& e : v) e = round_bf16(e);  // bf16-valued: the upload's rounding is exact
  f32.owned.resize(v.size() * 4);
  std::memcpy(f32.owned.data(), v.data(), f32.owned.size());
  f32.data = f32.owned;
  parts.push_back(std::move(f32));
  check_bf16_linear("bf16 from fp8+f32", parts, {1, 9, 64, 100}, 44);
}

TEST_F(LinearCudaTest, Bf16FlashCompressorStack) {
  std::mt19937_64 rng(45);
  std::vector<WeightMatrix> parts;
  parts.push_back(random_bf16("compressor.wkv", 1024, 4096, rng));
  parts.push_back(random_bf16("compressor.wgate", 1024, 4096, rng));
  parts.push_back(random_bf16("indexer.compressor.wkv", 256, 4096, rng));
  parts.push_back(random_bf16("indexer.compressor.wgate", 256, 4096, rng));
  parts.push_back(random_bf16("indexer.weights_proj", 64, 4096, rng));
  check_bf16_linear("bf16 stack 2624x4096", parts, {1, 8, 64, 512}, 46);
}

// ---- subnormal codes ------------------------------------------------------------------

// Outputs made only of e4m3 subnormal codes: every weight code is subnormal
// (or zero), and every activation block has one large element, at a column
// where the weight is zero, so the block's other elements quantize to
// subnormal codes. A path that flushes subnormal operands (f16 / bf16 MMA
// inputs, the bf16 decoder's multiply) outputs zeros here; with random data
// their share of an output is far below the bf16 rounding.
TEST_F(LinearCudaTest, SubnormalCodesAreExact) {
  std::mt19937_64 rng(71);
  const int64_t n = 256, k = 256;
  WeightMatrix w;
  w.name = "subnormal";
  w.rows = n, w.cols = k, w.dtype = DType::kF8E4M3;
  w.owned.resize(size_t(n * k));
  for (int64_t r = 0; r < n; ++r)
    for (int64_t c = 0; c < k; ++c)
      w.owned[size_t(r * k + c)] = c % 128 == 0 ? 0 : uint8_t((rng() % 2 ? 0x80 : 0) | (1 + rng() % 7));
  w.data = w.owned;
  for (int64_t b = 0; b < 4; ++b) w.block_scales.push_back(std::ldexp(1.0f, -2 - int(b)));
  const int m = 16, groups = 2;
  auto activation = [&](int64_t cols) {
    std::vector<float> x(size_t(m) * size_t(cols));
    for (int r = 0; r < m; ++r)
      for (int64_t c = 0; c < cols; ++c) {
        const float tiny = std::ldexp(1.0f + float(rng() % 1024) / 1024.0f, -16) * (rng() % 2 ? -1.0f : 1.0f);
        x[size_t(r * cols + c)] = round_bf16(c % 128 == 0 ? 1.0f : tiny);
      }
    return x;
  };
  const std::vector<float> wf = w.dequantize(), awf = absolute(wf);

  // FP8 x FP8: both operands subnormal codes.
  {
    Fp8Linear gpu(w);
    LinearWorkspace ws({gpu.needs(m)});
    const std::vector<float> x = activation(k), xq = fake_quantized(x);
    std::vector<float> c(size_t(m * n)), s(c.size());
    reference(xq.data(), k, m, wf.data(), awf.data(), n, k, c.data(), s.data(), n);
    const DeviceAct act = quantized_on_gpu(x, m, k, 16);
    for (LinearPath path : {LinearPath::kSmallM, LinearPath::kCublas}) {
      gpu.set_options({path, 32});
      DeviceArray<uint16_t> y(std::vector<uint16_t>(size_t(m * n), kPoison16));
      gpu.forward(Fp8Act(act.out()), y.get(), n, ws, nullptr);
      sync();
      const std::string label = std::string("subnormal fp8 ") + (path == LinearPath::kCublas ? "cublas" : "own");
      EXPECT_EQ(gpu.last_route().cublas_rows, path == LinearPath::kCublas ? m : 0) << label << gpu.last_route().note;
      expect_close(label, bf16_values(y.download()), n, c, n, s, m, n, 0x1p-8, 0.0,
                   row_bounds(gpu.last_route(), m, kECublasFp8));
    }
  }
  // FP8 weight x bf16: the weight's subnormal codes through the bf16 decoder.
  {
    W8A16GroupedLinear gpu(w, groups);
    LinearWorkspace ws({gpu.needs(m)});
    const int64_t kin = groups * k, nout = n, n_g = n / groups;
    const std::vector<float> x = activation(kin);
    std::vector<float> c(size_t(m * nout)), s(c.size());
    for (int g = 0; g < groups; ++g)
      reference(x.data() + g * k, kin, m, wf.data() + g * n_g * k, awf.data() + g * n_g * k, n_g, k, c.data() + g * n_g,
                s.data() + g * n_g, nout);
    DeviceArray<uint16_t> xd(to_bf16(x));
    for (LinearPath path : {LinearPath::kSmallM, LinearPath::kCublas, LinearPath::kGemm}) {
      gpu.set_options({{path, 32}});
      DeviceArray<uint16_t> y(std::vector<uint16_t>(size_t(m * nout), kPoison16));
      gpu.forward(xd.get(), kin, m, y.get(), nout, nullptr, ws, nullptr);
      sync();
      const std::string label = std::string("subnormal w8a16") + path_name(path);
      expect_close(label, bf16_values(y.download()), nout, c, nout, s, m, nout, 0x1p-8, 0.0,
                   row_bounds(gpu.last_route(), m, kECublasBf16));
    }
  }
}

// ---- no-ops, bad shapes, graphs ---------------------------------------------------

TEST_F(LinearCudaTest, ZeroRowsIsANoOp) {
  std::mt19937_64 rng(51);
  const WeightMatrix w8 = random_fp8("w", 256, 256, rng);
  const WeightMatrix wb = random_bf16("w", 256, 256, rng);
  Fp8Linear fp8(w8);
  W8A16GroupedLinear wo_a(w8, 2);
  Bf16Linear bf16(wb);
  LinearWorkspace ws({fp8.needs(8), wo_a.needs(8), bf16.needs(8)});
  DeviceArray<uint16_t> y(std::vector<uint16_t>(256 * 4, kPoison16));
  DeviceArray<float> yf(std::vector<float>(256 * 4, poison_f32()));
  DeviceAct act(0, 256);
  for (LinearPath path : {LinearPath::kSmallM, LinearPath::kCublas, LinearPath::kAuto}) {
    fp8.set_options({path, 32});
    wo_a.set_options({{path, 32}});
    bf16.set_options({path, 32});
    const Fp8ActOut q = act.out();
    fp8.forward(Fp8Act(q), y.get(), 256, ws, nullptr);
    wo_a.forward(y.get(), 256, 0, y.get(), 256, &q, ws, nullptr);
    bf16.forward(y.get(), 256, 0, yf.get(), 256, ws, nullptr);
    cuda::quantize_act(y.get(), 256, q, nullptr);
  }
  sync();
  for (uint16_t v : y.download()) ASSERT_EQ(v, kPoison16);
  for (float v : yf.download()) ASSERT_TRUE(std::isnan(v));
  EXPECT_EQ(fp8.last_route().rows, 0);
  EXPECT_EQ(fp8.last_route().kernel_launches, 0);
}

TEST_F(LinearCudaTest, BadShapesThrowBeforeLaunching) {
  std::mt19937_64 rng(53);
  const WeightMatrix w8 = random_fp8("w", 256, 256, rng);
  const WeightMatrix w8_other_cols = random_fp8("w2", 128, 384, rng);
  const WeightMatrix w8_odd_rows = random_fp8("w3", 200, 256, rng);
  const WeightMatrix w8_odd_cols = random_fp8("w4", 128, 200, rng);
  const WeightMatrix wb = random_bf16("wb", 256, 256, rng);
  Fp8Linear fp8(w8);
  W8A16GroupedLinear wo_a(w8, 2);
  Bf16Linear bf16(wb);
  LinearWorkspace ws({fp8.needs(16), wo_a.needs(16), bf16.needs(16)});
  LinearWorkspace tiny({cuda::LinearNeeds{}}, 0);
  DeviceArray<uint16_t> xin(std::vector<uint16_t>(size_t(64 * 520), 0));
  DeviceArray<uint16_t> y(std::vector<uint16_t>(size_t(64 * 264), kPoison16));
  DeviceArray<float> yf(std::vector<float>(size_t(64 * 264), poison_f32()));
  DeviceAct act(8, 256), act_big(40, 256), act_384(8, 384);
  const Fp8ActOut a = act.out();
  auto expect_error = [](const std::function<void()>& f, const std::string& words) {
    const std::string msg = error_of(f);
    EXPECT_NE(msg.find(words), std::string::npos) << "message: " << msg;
  };
  // Construction.
  expect_error([&] { Fp8Linear bad(std::vector<const WeightMatrix*>{&w8, &w8_other_cols}); }, "columns");
  expect_error([&] { Fp8Linear bad(std::vector<const WeightMatrix*>{&w8_odd_rows, &w8}); }, "multiple of 128 rows");
  expect_error([&] { Fp8Linear bad(wb); }, "not FP8");
  expect_error([&] { Fp8Linear bad(w8_odd_cols); }, "multiple of 128");
  expect_error([&] { W8A16GroupedLinear bad(w8, 3); }, "groups");
  expect_error([&] { W8A16GroupedLinear bad(w8, 4); }, "multiple of 128");
  // Fp8Linear::forward.
  expect_error([&] { fp8.forward(Fp8Act(act_384.out()), y.get(), 256, ws, nullptr); }, "columns");
  expect_error([&] { fp8.forward(Fp8Act(act_big.out()), y.get(), 256, ws, nullptr); }, "max_m");
  expect_error([&] { fp8.forward(Fp8Act(a), y.get(), 255, ws, nullptr); }, "row stride");
  expect_error([&] { fp8.forward(Fp8Act(a), nullptr, 256, ws, nullptr); }, "null");
  expect_error([&] { fp8.forward(Fp8Act(a), y.get(), 256, tiny, nullptr); }, "max_m");
  Fp8Act bad_scales = Fp8Act(a);
  bad_scales.scale_ld = 7;
  expect_error([&] { fp8.forward(bad_scales, y.get(), 256, ws, nullptr); }, "scale_ld");
  Fp8Act misaligned = Fp8Act(a);
  misaligned.data += 1;
  expect_error([&] { fp8.forward(misaligned, y.get(), 256, ws, nullptr); }, "aligned");
  // A residual tail that is not this output's (y, its stride, rows, columns or mode), or two tails.
  ResidualOut res(std::vector<float>(size_t(8) * 256, 1.0f), 8, 256);
  DeviceArray<int> real(std::vector<int>{8});
  cuda::ResidualNormParams r = res.params(8, 256, real.get());
  r.y = y.get();
  ASSERT_TRUE(fp8.fuses({.residual = &r}, 8)) << "the cases below need the tail";
  using Mismatch = std::function<void(cuda::ResidualNormParams&)>;
  const std::vector<std::pair<Mismatch, std::string>> mismatches = {
      {[&](cuda::ResidualNormParams& b) { b.y = res.y.get(); }, "residual tail must add"},
      {[](cuda::ResidualNormParams& b) { b.y_ld = 264; }, "residual tail must add"},
      {[](cuda::ResidualNormParams& b) { b.num_tokens = 7; }, "residual tail must add"},
      {[](cuda::ResidualNormParams& b) { b.dim = 128; }, "columns"},  // residual_norm's own check of x_fp8 first
      {[&](cuda::ResidualNormParams& b) {
         b.mode = cuda::ResidualMode::kLoad;
         b.input = res.h.get(), b.input_ld = 256;
       },
       "residual tail must add"}};
  for (const auto& [mismatch, words] : mismatches) {
    cuda::ResidualNormParams bad = r;
    mismatch(bad);
    expect_error([&] { fp8.forward(Fp8Act(a), y.get(), 256, ws, nullptr, {.residual = &bad}); }, words);
  }
  const cuda::QHeadNormRopeParams no_q{};
  expect_error([&] { fp8.forward(Fp8Act(a), y.get(), 256, ws, nullptr, {.q_head = &no_q, .residual = &r}); },
               "one tail at a time");
  // W8A16GroupedLinear::forward (2 groups of [128, 256]: input 512 columns, output 256).
  expect_error([&] { wo_a.forward(xin.get(), 200, 8, y.get(), 256, nullptr, ws, nullptr); }, "row stride");
  expect_error([&] { wo_a.forward(xin.get() + 1, 520, 8, y.get(), 256, nullptr, ws, nullptr); }, "aligned");
  expect_error([&] { wo_a.forward(xin.get(), 520, 8, y.get(), 128, nullptr, ws, nullptr); }, "row stride");
  const Fp8ActOut wrong_q = act_384.out();
  expect_error([&] { wo_a.forward(xin.get(), 520, 8, y.get(), 256, &wrong_q, ws, nullptr); }, "FP8 output");
  expect_error([&] { wo_a.forward(xin.get(), 520, 40, y.get(), 256, nullptr, ws, nullptr); }, "max_m");
  W8A16GroupedLinear wo_a_200(w8_odd_rows, 1);  // 200 output columns: no whole blocks to quantize
  Fp8ActOut q_200 = a;
  q_200.cols = 200;
  expect_error([&] { wo_a_200.forward(xin.get(), 520, 8, y.get(), 256, &q_200, ws, nullptr); },
               "multiple of 128 columns");
  // Bf16Linear::forward.
  expect_error([&] { bf16.forward(xin.get(), 128, 8, yf.get(), 256, ws, nullptr); }, "row stride");
  expect_error([&] { bf16.forward(xin.get(), 264, 8, nullptr, 256, ws, nullptr); }, "null");
  expect_error([&] { bf16.forward(xin.get(), 264, -1, yf.get(), 256, ws, nullptr); }, "negative");
  // quantize_act.
  Fp8ActOut q_bad = a;
  q_bad.cols = 200;
  expect_error([&] { cuda::quantize_act(y.get(), 264, q_bad, nullptr); }, "multiple of 128");
  q_bad = a;
  q_bad.scale_ld = 4;
  expect_error([&] { cuda::quantize_act(y.get(), 264, q_bad, nullptr); }, "scale_ld");
  expect_error([&] { cuda::quantize_act(y.get(), 100, a, nullptr); }, "row stride");

  sync();
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
  for (uint16_t v : y.download()) ASSERT_EQ(v, kPoison16) << "an output was written";
  for (float v : yf.download()) ASSERT_TRUE(std::isnan(v)) << "an output was written";
  for (uint8_t v : act.data->download()) ASSERT_EQ(v, kPoison8) << "an FP8 output was written";
  for (float v : res.h.download()) ASSERT_EQ(v, 1.0f) << "h was changed";
}

// The diagnostics instantiation of the small-M kernel (set_small_m_stamps)
// gives the plain one's bits, and every CTA of the launch, and nothing past
// it, stamps each point in order: with splits summed in a cluster (2) and
// through the workspace (3, where CTAs that only arrive stamp their last two
// points at once).
TEST_F(LinearCudaTest, SmallMStampsLeaveTheProductAlone) {
  std::mt19937_64 rng(67);
  const int groups = 4;
  const int64_t n = groups * 256, kg = 768, k = groups * kg;
  const WeightMatrix w = random_fp8("wo_a", n, kg, rng);
  W8A16GroupedLinear wo_a(w, groups);
  constexpr int kPoints = cuda::kSmallMStampCount;
  for (int splits : {2, 3}) {
    for (int m : {1, 8}) {
      const std::string at = "splits " + std::to_string(splits) + " m=" + std::to_string(m);
      W8A16Options o;
      o.path = LinearPath::kSmallM;
      o.splits = splits;
      wo_a.set_options(o);
      LinearWorkspace ws({wo_a.needs(m)});
      DeviceArray<uint16_t> xd(to_bf16(random_activation(m, k, rng)));
      DeviceAct q(m, n);
      DeviceArray<uint16_t> y(std::vector<uint16_t>(size_t(m) * n, kPoison16));
      auto run = [&] {
        y.upload(std::vector<uint16_t>(size_t(m) * n, kPoison16));
        q.data->upload(std::vector<uint8_t>(size_t((m + 1) * q.ld), kPoison8));
        const Fp8ActOut qo = q.out();
        wo_a.forward(xd.get(), k, m, y.get(), n, &qo, ws, nullptr);
        sync();
        return std::make_pair(y.download(), q.data->download());
      };
      const auto plain = run();
      const int ctas = int(n / 128) * splits;
      DeviceArray<unsigned long long> stamps(std::vector<unsigned long long>(size_t(ctas + 1) * kPoints, 0));
      const auto stamped = [&] {
        struct On {  // off again however run() leaves
          explicit On(unsigned long long* b) { cuda::set_small_m_stamps(b); }
          ~On() { cuda::set_small_m_stamps(nullptr); }
        } on(stamps.get());
        return run();
      }();
      const LinearRoute route = wo_a.last_route();
      ASSERT_EQ(route.kernel_rows, m) << at;
      EXPECT_EQ(route.splits, splits) << at;
      EXPECT_EQ(route.kernel_cluster_sum, splits == 2) << at;
      EXPECT_TRUE(stamped.first == plain.first) << at << ": y";
      EXPECT_TRUE(stamped.second == plain.second) << at << ": the FP8 output";
      const std::vector<unsigned long long> h = stamps.download();
      for (int c = 0; c < ctas; ++c) {
        EXPECT_NE(h[size_t(c) * kPoints], 0u) << at << ": CTA " << c << " did not stamp its entry";
        for (int p = 1; p < kPoints; ++p)
          EXPECT_LE(h[size_t(c) * kPoints + p - 1], h[size_t(c) * kPoints + p]) << at << ": CTA " << c << " point " << p;
      }
      for (int p = 0; p < kPoints; ++p) EXPECT_EQ(h[size_t(ctas) * kPoints + p], 0u) << at << ": past the grid";
    }
  }
}

// A decode step's linears captured in a CUDA graph (both paths, split-K with
// its counters, the fused FP8 output) replay to the eager results.
TEST_F(LinearCudaTest, GraphReplayMatchesEagerRuns) {
  std::mt19937_64 rng(61);
  const WeightMatrix w8 = random_fp8("w", 1024, 2048, rng);
  const WeightMatrix wo = random_fp8("wo_a", 4 * 256, 512, rng);
  const WeightMatrix wb = random_bf16("wb", 264, 2048, rng);
  Fp8Linear fp8(w8);
  W8A16GroupedLinear wo_a(wo, 4);
  Bf16Linear bf16(wb);
  const int m = 24;
  LinearWorkspace ws({fp8.needs(m), wo_a.needs(m), bf16.needs(m)});
  const std::vector<float> x = random_activation(m, 2048, rng);
  DeviceArray<uint16_t> xd(to_bf16(x));
  DeviceAct act(m, 2048, m), q(m, 1024);
  DeviceArray<uint16_t> y1(std::vector<uint16_t>(size_t(m) * 1024, kPoison16)), y2(std::vector<uint16_t>(size_t(m) * 1024, kPoison16));
  DeviceArray<float> y3(std::vector<float>(size_t(m) * 264, poison_f32()));
  cudaStream_t stream;
  cuda_ok(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "stream");
  auto step = [&](LinearPath path) {
    fp8.set_options({path, 32});
    wo_a.set_options({{path, 32}});
    bf16.set_options({path, 32});
    const Fp8ActOut qo = q.out();
    cuda::quantize_act(xd.get(), 2048, act.out(), stream);
    fp8.forward(Fp8Act(act.out()), y1.get(), 1024, ws, stream);
    wo_a.forward(xd.get(), 2048, m, y2.get(), 1024, &qo, ws, stream);
    bf16.forward(xd.get(), 2048, m, y3.get(), 264, ws, stream);
  };
  for (LinearPath path : {LinearPath::kSmallM, LinearPath::kCublas}) {
    step(path);
    cuda_ok(cudaStreamSynchronize(stream), "eager");
    const auto e1 = y1.download(), e2 = y2.download();
    const auto e3 = y3.download();
    const auto eq = q.data->download();
    cudaGraph_t graph;
    cuda_ok(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal), "begin capture");
    step(path);
    cuda_ok(cudaStreamEndCapture(stream, &graph), "end capture");
    cudaGraphExec_t exec;
    cuda_ok(cudaGraphInstantiate(&exec, graph, 0), "instantiate");
    for (int rep = 0; rep < 3; ++rep) {
      y1.upload(std::vector<uint16_t>(size_t(m) * 1024, kPoison16));
      y2.upload(std::vector<uint16_t>(size_t(m) * 1024, kPoison16));
      y3.upload(std::vector<float>(size_t(m) * 264, poison_f32()));
      q.data->upload(std::vector<uint8_t>(size_t((m + 1) * q.ld), kPoison8));
      cuda_ok(cudaGraphLaunch(exec, stream), "graph launch");
      cuda_ok(cudaStreamSynchronize(stream), "replay");
      EXPECT_TRUE(y1.download() == e1) << "fp8 replay " << rep;
      EXPECT_TRUE(y2.download() == e2) << "wo_a replay " << rep;
      const auto r3 = y3.download();
      EXPECT_EQ(std::memcmp(r3.data(), e3.data(), e3.size() * 4), 0) << "bf16 replay " << rep;
      EXPECT_TRUE(q.data->download() == eq) << "wo_a FP8 output replay " << rep;
    }
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
  }
  cudaStreamDestroy(stream);
}

}  // namespace
}  // namespace dsv4::test
