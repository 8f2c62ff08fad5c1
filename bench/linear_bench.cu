// Times the attention layer's linears (attn/cuda/linear.h) on Flash's shapes
// at M in {1, 2, 4, 8, 16, 32, 64, 128, 512, 4096}: the automatic path
// ("ours": own kernel up to small_m_max rows, cuBLASLt above) next to
// cuBLASLt alone measured in the same run (block-scaled FP8 for the FP8
// linears, bf16 for wo_a and the bf16 stack), the own wgmma GEMM alone
// (LinearPath::kGemm: FP8 products and wo_a) with its split of k, the weight bytes, the roofline
// time (max of bytes / 4.3 TB/s and FLOPs / peak: 1,270 TFLOP/s FP8, 790
// bf16) and ours / roofline.
//
// Every number is a median over graph replays: a graph holds R calls that
// cycle through C copies of the weight (C x weight bytes >= 256 MB, several
// times the 50-60 MB L2, so every call streams its weight from HBM), and its
// replay time divided by R is one sample. wo_a rows include its FP8 output
// for wo_b (fused into our small-M kernel; a separate quantize kernel after
// cuBLASLt). cuBLASLt takes FP8 block-scaled problems only for M a multiple
// of 8: below 8 its column shows "-".
//
//   linear_bench [--quick] [--hot] [--shape NAME] [--splits N] [--small-m-max N] [--reps N] [--m M,M,...]
//   linear_bench --candidates [--shape NAME] [--hot] [--reps N]
//
// --quick: M in {1, 8, 64, 512}; --m: the row counts given; --hot: one weight copy, so every call reads
// its weight from L2 where it fits (what an L2 prefetch could reach); --stamps: for wo_a at up to 8
// rows, the small-M kernel's phases per CTA (small_m_stamps.h); --shape: rows whose name contains NAME;
// --splits: force the own kernel's split of k; --small-m-max: the automatic
// path's threshold (default 32); --candidates: every algorithm cuBLASLt's
// heuristic offers for each cuBLASLt shape at M in {32, 64, 128, 256, 512}
// (for block-scaled FP8, whose heuristic offers one, that one with k split
// 1-16 ways), timed the same way, with its configuration, whether two runs
// give the same bits, and its largest difference from the first candidate;
// * marks the one the linears run.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "attn/cuda/cublaslt_matmul.h"
#include "attn/cuda/linear.h"
#include "model/weights.h"

#include "bench_util.cuh"
#include "small_m_stamps.h"

namespace {

using namespace dsv4;
using namespace dsv4::cuda;

using bench::kPeakBf16;
using bench::kPeakBytes;
using bench::kPeakFp8;
constexpr double kRotateBytes = 256e6;

// Random e4m3 codes (no NaN) with power-of-two block scales 2^-10 .. 2^-6.
WeightMatrix host_fp8(const std::string& name, int64_t rows, int64_t cols, uint64_t seed) {
  WeightMatrix w;
  w.name = name;
  w.rows = rows, w.cols = cols;
  w.dtype = DType::kF8E4M3;
  w.owned.resize(size_t(rows * cols));
  for (size_t i = 0; i < w.owned.size(); i += 8) {
    const uint64_t r = mix64(seed ^ i);
    for (size_t b = 0; b < 8 && i + b < w.owned.size(); ++b) {
      uint8_t c = uint8_t(r >> (8 * b));
      if ((c & 0x7f) == 0x7f) c ^= 1;
      w.owned[i + b] = c;
    }
  }
  w.data = w.owned;
  w.block_scales.resize(size_t(((rows + 127) / 128) * ((cols + 127) / 128)));
  for (size_t i = 0; i < w.block_scales.size(); ++i) w.block_scales[i] = std::ldexp(1.0f, -6 - int(mix64(seed + i) % 5));
  return w;
}

// Random bf16 weights in +-[2^-8, 2^-6).
WeightMatrix host_bf16(const std::string& name, int64_t rows, int64_t cols, uint64_t seed) {
  WeightMatrix w;
  w.name = name;
  w.rows = rows, w.cols = cols;
  w.dtype = DType::kBF16;
  w.owned.resize(size_t(rows * cols) * 2);
  for (size_t i = 0; i < size_t(rows * cols); ++i) {
    const uint64_t r = mix64(seed ^ (i * 0x9e3779b97f4a7c15ull));
    const uint16_t bits = uint16_t(((r & 1) << 15) | ((119 + ((r >> 1) % 2)) << 7) | ((r >> 3) & 0x7f));
    std::memcpy(w.owned.data() + 2 * i, &bits, 2);
  }
  w.data = w.owned;
  return w;
}

__global__ void fill_bf16(uint16_t* x, size_t n, uint64_t seed) {
  const size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  uint64_t v = seed ^ (i * 0x9e3779b97f4a7c15ull);
  v ^= v >> 31;
  v *= 0xbf58476d1ce4e5b9ull;
  v ^= v >> 29;
  x[i] = uint16_t(((v & 1) << 15) | ((125 + ((v >> 1) % 3)) << 7) | ((v >> 3) & 0x7f));  // +-[0.25, 2)
}

template <typename T>
T* device_alloc(size_t count) {
  T* p = nullptr;
  CHECK(cudaMalloc(&p, std::max<size_t>(count, 1) * sizeof(T)));
  return p;
}

enum class Kind { kFp8, kW8A16, kW8A16Fp8Input, kBf16 };

struct Shape {
  std::string name;
  Kind kind;
  std::vector<int64_t> rows;  // stacked parts (kW8A16: all groups)
  int64_t k;                  // input columns (kW8A16: per group)
  int groups = 1;
};

struct Options {
  bool quick = false;
  std::string filter;
  int small_m_max = 32;
  int splits = 0;  // the own kernel's split of k (0: automatic)
  int reps = 15;
  bool hot = false;  // one weight copy: every call after the first reads it from L2
  bool candidates = false;
  bool stamps = false;  // --stamps: wo_a's small-M phases per CTA (up to 8 rows)
  std::vector<int> ms;  // --m: these row counts instead
};

// The C weight copies of one shape, any kind.
struct Copies {
  Kind kind;
  std::vector<std::unique_ptr<Fp8Linear>> fp8;
  std::vector<std::unique_ptr<W8A16GroupedLinear>> wo_a;
  std::vector<std::unique_ptr<Bf16Linear>> bf16;
  size_t count() const { return fp8.size() + wo_a.size() + bf16.size(); }
  void set_path(LinearPath path, int small_m_max, int splits) {
    for (auto& l : fp8) l->set_options({path, small_m_max, splits});
    for (auto& l : bf16) l->set_options({path, small_m_max, splits});
    for (auto& l : wo_a) {
      W8A16Options o = l->options();
      o.path = path, o.small_m_max = small_m_max, o.splits = splits;
      l->set_options(o);
    }
  }
  LinearNeeds needs(int max_m) const {
    if (!fp8.empty()) return fp8[0]->needs(max_m);
    if (!wo_a.empty()) return wo_a[0]->needs(max_m);
    return bf16[0]->needs(max_m);
  }
  const LinearRoute& route() const {
    if (!fp8.empty()) return fp8.back()->last_route();
    if (!wo_a.empty()) return wo_a.back()->last_route();
    return bf16.back()->last_route();
  }
};

Copies make_copies(const Shape& s, uint64_t seed, bool hot) {
  Copies c;
  c.kind = s.kind;
  std::vector<WeightMatrix> parts;
  parts.reserve(s.rows.size());
  int64_t n = 0;
  for (size_t i = 0; i < s.rows.size(); ++i) {
    const std::string name = s.name + "." + std::to_string(i);
    parts.push_back(s.kind == Kind::kBf16 ? host_bf16(name, s.rows[i], s.k, seed + i)
                                          : host_fp8(name, s.rows[i], s.k, seed + i));
    n += s.rows[i];
  }
  std::vector<const WeightMatrix*> ptrs;
  for (const WeightMatrix& w : parts) ptrs.push_back(&w);
  const double bytes = double(n * s.k) * (s.kind == Kind::kBf16 ? 2 : 1);
  const int copies = hot ? 1 : int(std::clamp(std::ceil(kRotateBytes / bytes), 2.0, 64.0));
  for (int i = 0; i < copies; ++i) {
    switch (s.kind) {
      case Kind::kFp8: c.fp8.push_back(std::make_unique<Fp8Linear>(ptrs)); break;
      case Kind::kBf16: c.bf16.push_back(std::make_unique<Bf16Linear>(ptrs)); break;
      case Kind::kW8A16:
      case Kind::kW8A16Fp8Input: {
        W8A16Options o;
        o.fp8_input = s.kind == Kind::kW8A16Fp8Input;
        o.bf16_copy = !o.fp8_input;
        c.wo_a.push_back(std::make_unique<W8A16GroupedLinear>(parts[0], s.groups, o));
        break;
      }
    }
  }
  return c;
}

// Inputs and outputs of one M.
struct Buffers {
  uint16_t* x = nullptr;  // bf16 [m, in]
  uint8_t* xq = nullptr;  // FP8 [m, in], scales [in / 128][m]
  float* xs = nullptr;
  uint16_t* y = nullptr;  // bf16 [m, out]
  float* yf = nullptr;    // fp32 [m, out]
  uint8_t* q = nullptr;   // FP8 [m, out], scales [out / 128][m]
  float* qs = nullptr;
  ~Buffers() {
    for (void* p : {(void*)x, (void*)xq, (void*)xs, (void*)y, (void*)yf, (void*)q, (void*)qs}) cudaFree(p);
  }
};

// One call of copy i (the linear's forward with its shape's inputs).
void call(Copies& c, size_t i, int m, int64_t in, int64_t out, const Buffers& b, LinearWorkspace& ws, cudaStream_t st) {
  switch (c.kind) {
    case Kind::kFp8: {
      const Fp8Act x{b.xq, b.xs, m, int(in), in, m};
      c.fp8[i]->forward(x, b.y, out, ws, st);
      break;
    }
    case Kind::kBf16: c.bf16[i]->forward(b.x, in, m, b.yf, out, ws, st); break;
    case Kind::kW8A16:
    case Kind::kW8A16Fp8Input: {
      const Fp8ActOut q{b.q, b.qs, m, int(out), out, m};
      c.wo_a[i]->forward(b.x, in, m, b.y, out, &q, ws, st);
      break;
    }
  }
}

// Median microseconds per call over graph replays of R calls cycling the copies.
double time_calls(Copies& c, int m, int64_t in, int64_t out, const Buffers& b, LinearWorkspace& ws,
                  cudaStream_t st, int reps) {
  const size_t copies = c.count();
  const int calls = int(std::max<size_t>(20, copies) / copies * copies);
  for (size_t i = 0; i < copies; ++i) call(c, i, m, in, out, b, ws, st);  // plans, warm-up
  CHECK(cudaStreamSynchronize(st));
  return bench::graph_median_us(st, calls, reps, [&](cudaStream_t s) {
    for (int i = 0; i < calls; ++i) call(c, size_t(i) % copies, m, in, out, b, ws, s);
  });
}

std::string route_text(const LinearRoute& r) {
  char buf[96];
  if (r.cublas_rows == r.rows)
    std::snprintf(buf, sizeof buf, "cublas k/%d", r.cublas_splits);
  else if (r.gemm_rows == r.rows)
    std::snprintf(buf, sizeof buf, "gemm s=%d x%d", r.splits, r.kernel_launches);
  else if (r.cublas_rows == 0)
    std::snprintf(buf, sizeof buf, "own s=%d x%d", r.splits, r.kernel_launches);
  else
    std::snprintf(buf, sizeof buf, "cublas %d + own %d", r.cublas_rows, r.kernel_rows);
  return buf;
}

void run_shape(const Shape& s, const std::vector<int>& ms, const Options& opt, uint64_t seed) {
  Copies c = make_copies(s, seed, opt.hot);
  int64_t n = 0;
  for (int64_t r : s.rows) n += r;
  const int64_t in = s.k * s.groups, out = n;
  const bool fp8_math = s.kind == Kind::kFp8 || s.kind == Kind::kW8A16Fp8Input;
  const double weight_bytes = double(n * s.k) * (s.kind == Kind::kBf16 ? 2 : 1);
  const int max_m = *std::max_element(ms.begin(), ms.end());
  // Sized under the forced split (--splits): a linear's needs() follow its options.
  c.set_path(LinearPath::kAuto, opt.small_m_max, opt.splits);
  LinearWorkspace ws({c.needs(max_m)});  // the own FP8 GEMM needs none of it
  cudaStream_t st;
  CHECK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  std::printf("\n%s: [%lld x %lld]%s, %d weight copies, %.1f MB each; workspace %.1f MB\n", s.name.c_str(),
              (long long)n, (long long)s.k, s.groups > 1 ? (" in " + std::to_string(s.groups) + " groups").c_str() : "",
              int(c.count()), weight_bytes / 1e6, ws.bytes() / 1e6);
  std::printf("  %5s  %-22s %10s %10s %16s %9s %10s %7s %9s %9s  %s\n", "M", "ours (path)", "ours us", "cuBLASLt",
              "gemm us (split)", "MB", "roofln us", "ratio", "TFLOP/s", "cuBL TF/s", "cuBLASLt note");
  for (int m : ms) {
    Buffers b;
    b.x = device_alloc<uint16_t>(size_t(m) * in);
    fill_bf16<<<unsigned((size_t(m) * in + 255) / 256), 256>>>(b.x, size_t(m) * in, seed + m);
    CHECK(cudaGetLastError());
    b.xq = device_alloc<uint8_t>(size_t(m) * in);
    b.xs = device_alloc<float>(size_t(in / 128) * m);
    quantize_act(b.x, in, Fp8ActOut{b.xq, b.xs, m, int(in), in, m}, nullptr);
    b.y = device_alloc<uint16_t>(size_t(m) * out);
    b.yf = device_alloc<float>(size_t(m) * out);
    b.q = device_alloc<uint8_t>(size_t(m) * out);
    b.qs = device_alloc<float>(size_t(out / 128 + 1) * m);
    CHECK(cudaDeviceSynchronize());

    c.set_path(LinearPath::kAuto, opt.small_m_max, opt.splits);
    const double ours = time_calls(c, m, in, out, b, ws, st, opt.reps);
    const LinearRoute ours_route = c.route();
    if (opt.stamps && s.kind == Kind::kW8A16 && m <= 8) {  // the same calls again, the last one stamped
      bench::SmallMStamps stamps;
      stamps.on();
      const double t = time_calls(c, m, in, out, b, ws, st, opt.reps);
      stamps.off();
      char label[96];
      std::snprintf(label, sizeof label, "  wo_a stamps at M = %d (%.2f us a call with them)", m, t);
      stamps.print(label);
    }
    c.set_path(LinearPath::kCublas, opt.small_m_max, opt.splits);
    double lt = time_calls(c, m, in, out, b, ws, st, opt.reps);
    const LinearRoute lt_route = c.route();
    const bool lt_valid = lt_route.cublas_rows == m;
    char gemm_col[32] = "-";
    if (fp8_math || s.kind == Kind::kW8A16) {  // the own wgmma GEMM applies
      c.set_path(LinearPath::kGemm, opt.small_m_max, opt.splits);
      const double g = time_calls(c, m, in, out, b, ws, st, opt.reps);
      std::snprintf(gemm_col, sizeof gemm_col, "%.2f (%d)", g, c.route().splits);
    }

    const double flops = 2.0 * m * double(n) * double(s.k);
    const double io_bytes = weight_bytes + double(m) * in * (fp8_math ? 1 : 2) +
                            double(m) * out * (s.kind == Kind::kBf16 ? 4 : 2);
    const double roof = 1e6 * std::max(io_bytes / kPeakBytes, flops / (fp8_math ? kPeakFp8 : kPeakBf16));
    char lt_col[32] = "-", lt_tf[32] = "-";
    if (lt_valid) {
      std::snprintf(lt_col, sizeof lt_col, "%.2f", lt);
      std::snprintf(lt_tf, sizeof lt_tf, "%.0f", flops / (lt * 1e-6) / 1e12);
    }
    std::printf("  %5d  %-22s %10.2f %10s %16s %9.1f %10.2f %7.2f %9.0f %9s  %s\n", m, route_text(ours_route).c_str(),
                ours, lt_col, gemm_col, io_bytes / 1e6, roof, ours / roof, flops / (ours * 1e-6) / 1e12, lt_tf,
                lt_valid ? "" : lt_route.note.c_str());
  }
  CHECK(cudaStreamDestroy(st));
}

// ---- --candidates: cuBLASLt's algorithms, one by one ------------------------------

__global__ void fill_bytes(uint8_t* p, size_t n, uint64_t seed, bool e4m3) {
  const size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  uint8_t c = uint8_t(bench::mix32(seed ^ i));
  if (e4m3 && (c & 0x7f) == 0x7f) c ^= 1;  // no NaN
  else if (!e4m3) c = (i & 1) ? uint8_t(((c & 0x80) | 0x3c) | ((c >> 6) & 1)) : c;  // bf16 pairs: +-[2^-7, 2^-5)
  p[i] = c;
}
__global__ void fill_floats(float* p, size_t n, float v) {
  const size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) p[i] = v;
}
template <typename T>
T* filled(size_t bytes, uint64_t seed, bool e4m3) {
  T* p = reinterpret_cast<T*>(device_alloc<uint8_t>(bytes));
  fill_bytes<<<unsigned((bytes + 255) / 256), 256>>>(reinterpret_cast<uint8_t*>(p), bytes, seed, e4m3);
  CHECK(cudaGetLastError());
  return p;
}
float* filled_floats(size_t n, float v) {
  float* p = device_alloc<float>(n);
  fill_floats<<<unsigned((n + 255) / 256), 256>>>(p, n, v);
  CHECK(cudaGetLastError());
  return p;
}

// The LtProblem the linears build for shape s at m rows (Fp8Product,
// W8A16GroupedLinear, Bf16Linear).
LtProblem lt_problem(const Shape& s, int m, size_t ws_bytes) {
  int64_t n = 0;
  for (int64_t r : s.rows) n += r;
  LtProblem p;
  p.workspace_bytes = ws_bytes;
  switch (s.kind) {
    case Kind::kFp8:
      p.kind = LtKind::kFp8BlockScaled;
      p.m = n, p.n = m, p.k = s.k, p.lda = s.k, p.ldb = s.k, p.ldd = n;
      break;
    case Kind::kW8A16:
      p.kind = LtKind::kBf16;
      p.m = n / s.groups, p.n = m, p.k = s.k, p.lda = s.k, p.ldb = s.k * s.groups, p.ldd = n;
      p.batch = s.groups, p.stride_a = p.m * s.k, p.stride_b = s.k, p.stride_d = p.m;
      break;
    case Kind::kBf16:
      p.kind = LtKind::kBf16ToF32;
      p.m = n, p.n = m, p.k = s.k, p.lda = s.k, p.ldb = s.k, p.ldd = n;
      break;
    case Kind::kW8A16Fp8Input: break;
  }
  return p;
}

void run_candidates(const Shape& s, const Options& opt, uint64_t seed) {
  if (s.kind == Kind::kW8A16Fp8Input) return;
  const bool fp8 = s.kind == Kind::kFp8;
  const size_t ab = fp8 ? 1 : 2, db = s.kind == Kind::kBf16 ? 4 : 2;
  int64_t n = 0;
  for (int64_t r : s.rows) n += r;
  const int64_t in = s.k * s.groups;
  const size_t w_bytes = size_t(n) * s.k * ab;
  const int copies = opt.hot ? 1 : int(std::clamp(std::ceil(kRotateBytes / double(w_bytes)), 2.0, 64.0));
  const size_t ws_bytes = LinearWorkspace::kDefaultCublasBytes;
  std::vector<uint8_t*> w;
  std::vector<float*> w_scales;
  for (int c = 0; c < copies; ++c) {
    w.push_back(filled<uint8_t>(w_bytes, seed + c, fp8));
    w_scales.push_back(fp8 ? filled_floats(size_t((n + 127) / 128) * lt_weight_scale_ld(s.k), 1.0f / 256) : nullptr);
  }
  void* ws = device_alloc<uint8_t>(ws_bytes);
  cudaStream_t st;
  CHECK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  std::printf("\n%s: [%lld x %lld]%s, %d weight copies of %.1f MB\n", s.name.c_str(), (long long)n, (long long)s.k,
              s.groups > 1 ? (" in " + std::to_string(s.groups) + " groups").c_str() : "", copies, w_bytes / 1e6);
  for (int m : {32, 64, 128, 256, 512}) {
    uint8_t* x = filled<uint8_t>(size_t(m) * in * ab, seed + 7 * m, fp8);
    float* xs = fp8 ? filled_floats(size_t(in / 128) * m, 1.0f / 64) : nullptr;
    const size_t y_bytes = size_t(m) * n * db;
    uint8_t* y = device_alloc<uint8_t>(y_bytes);
    LtMatmul plan(lt_problem(s, m, ws_bytes));
    if (!plan.supported()) {
      std::printf("  M %4d: %s\n", m, plan.reason().c_str());
      for (void* p : {(void*)x, (void*)xs, (void*)y}) cudaFree(p);
      continue;
    }
    if (fp8)  // cuBLASLt offers one block-scaled FP8 algorithm: try it with k split
      for (int splits : {1, 2, 3, 4, 6, 8, 12, 16}) plan.add_split_candidate(splits);
    const int automatic = plan.chosen();
    auto run = [&](int c, cudaStream_t stream) { plan.run(w[c], w_scales[c], x, xs, y, ws, stream); };
    std::vector<uint8_t> first(y_bytes), again(y_bytes), mine(y_bytes);
    for (int i = 0; i < plan.candidates(); ++i) {
      plan.choose(i);
      run(0, st);
      CHECK(cudaMemcpyAsync(mine.data(), y, y_bytes, cudaMemcpyDeviceToHost, st));
      run(0, st);
      CHECK(cudaMemcpyAsync(again.data(), y, y_bytes, cudaMemcpyDeviceToHost, st));
      CHECK(cudaStreamSynchronize(st));
      if (i == 0) first = mine;
      double diff = 0;  // largest |difference| from candidate 0, in units of its largest |value|
      double big = 0;
      for (size_t e = 0; e < y_bytes / db; ++e) {
        auto at = [&](const std::vector<uint8_t>& v) {
          if (db == 4) {
            float f;
            std::memcpy(&f, v.data() + 4 * e, 4);
            return double(f);
          }
          uint32_t u = uint32_t(v[2 * e]) << 16 | uint32_t(v[2 * e + 1]) << 24;
          float f;
          std::memcpy(&f, &u, 4);
          return double(f);
        };
        diff = std::max(diff, std::fabs(at(mine) - at(first)));
        big = std::max(big, std::fabs(at(first)));
      }
      const int calls = std::max(20, copies) / copies * copies;
      const double us = bench::graph_median_us(st, calls, opt.reps, [&](cudaStream_t s2) {
        for (int c = 0; c < calls; ++c) run(c % copies, s2);
      });
      std::printf("  M %4d  #%-2d%s %9.2f us  %-4s diff %.1e  %s\n", m, i, i == automatic ? "*" : " ", us,
                  mine == again ? "det" : "NDET", big > 0 ? diff / big : diff, plan.describe(i).c_str());
    }
    for (void* p : {(void*)x, (void*)xs, (void*)y}) cudaFree(p);
  }
  for (int c = 0; c < copies; ++c) cudaFree(w[c]), cudaFree(w_scales[c]);
  cudaFree(ws);
  CHECK(cudaStreamDestroy(st));
}

}  // namespace

int main(int argc, char** argv) {
  Options opt;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--quick") {
      opt.quick = true;
    } else if (a == "--shape" && i + 1 < argc) {
      opt.filter = argv[++i];
    } else if (a == "--splits" && i + 1 < argc) {
      opt.splits = std::atoi(argv[++i]);
    } else if (a == "--small-m-max" && i + 1 < argc) {
      opt.small_m_max = std::atoi(argv[++i]);
    } else if (a == "--candidates") {
      opt.candidates = true;
    } else if (a == "--hot") {
      opt.hot = true;
    } else if (a == "--stamps") {
      opt.stamps = true;
    } else if (a == "--reps" && i + 1 < argc) {
      opt.reps = std::max(1, std::atoi(argv[++i]));
    } else if (a == "--m" && i + 1 < argc) {
      for (const char* p = argv[++i]; *p;) {
        const int m = std::atoi(p);
        if (m > 0) opt.ms.push_back(m);
        while (*p && *p != ',') ++p;
        if (*p == ',') ++p;
      }
    } else {
      std::fprintf(stderr,
                   "usage: %s [--quick] [--hot] [--stamps] [--shape NAME] [--splits N] [--small-m-max N] [--reps N] [--m M,M,...]\n"
                   "       %s --candidates [--shape NAME] [--hot] [--reps N]\n",
                   argv[0], argv[0]);
      return 2;
    }
  }
  int dev = 0;
  cudaDeviceProp prop{};
  CHECK(cudaGetDevice(&dev));
  CHECK(cudaGetDeviceProperties(&prop, dev));
  std::printf("device: %s, %d SMs, L2 %.0f MB; small_m_max %d, splits %s\n", prop.name, prop.multiProcessorCount,
              prop.l2CacheSize / 1e6, opt.small_m_max,
              opt.splits > 0 ? std::to_string(opt.splits).c_str() : "auto");
  const std::vector<int> ms = !opt.ms.empty() ? opt.ms
                             : opt.quick      ? std::vector<int>{1, 8, 64, 512}
                                              : std::vector<int>{1, 2, 4, 8, 16, 32, 64, 128, 512, 4096};
  const std::vector<Shape> shapes = {
      {"wq_a+wkv", Kind::kFp8, {1024, 512}, 4096},
      {"wq_b", Kind::kFp8, {32768}, 1024},
      {"wo_a group (fp8)", Kind::kFp8, {1024}, 4096},
      {"wo_a", Kind::kW8A16, {8192}, 4096, 8},
      {"wo_a fp8_input", Kind::kW8A16Fp8Input, {8192}, 4096, 8},
      {"wo_b", Kind::kFp8, {4096}, 8192},
      {"indexer.wq_b", Kind::kFp8, {8192}, 1024},
      {"compressor stack (bf16)", Kind::kBf16, {1024, 1024, 256, 256, 64}, 4096},
  };
  uint64_t seed = 1;
  for (const Shape& s : shapes) {
    if (!opt.filter.empty() && s.name.find(opt.filter) == std::string::npos) continue;
    if (opt.candidates)
      run_candidates(s, opt, seed += 1000);
    else
      run_shape(s, ms, opt, seed += 1000);
  }
  return 0;
}
