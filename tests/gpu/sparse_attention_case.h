#pragma once
// Random sparse-attention problems for the GPU tests: fp8_ds_mla pages whose
// unreferenced bytes are all 0xFF (NaN codes and NaN scales, so that a stray
// read shows up as NaN), index lists with -1 holes, out-of-range slots,
// ragged and empty rows, plus device copies, the float64 reference
// (tests/support/attention_reference.h) and the comparison of SPEC-level
// tolerances: relative L2 per (token, head) row <= 1e-2, |lse diff| <= 1e-5.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "support/cuda_device.h"
#include "../support/attention_reference.h"
#include "attn/cuda/sparse_attention_cuda.h"
#include "attn/sparse_attention.h"
#include "cache/fp8_ds_mla.h"
#include "numerics/bf16.h"

namespace dsv4::test {

#define DSV4_CUDA_OK(expr)                                                           \
  do {                                                                               \
    const cudaError_t e_ = (expr);                                                   \
    ASSERT_EQ(e_, cudaSuccess) << #expr << ": " << cudaGetErrorString(e_);           \
  } while (0)

struct CaseSpec {
  int tokens = 8;
  int heads = 64;
  int swa_width = 128;
  int extra_width = 0;     // 0: no extra list
  int extra_page = 64;     // entries per page of the extra cache (64 or 2 in SPEC §8)
  bool ragged = true;      // lengths uniform in [0, width]; else full width
  double hole_rate = 0.05;  // -1 slots inside the lengths
  double oor_rate = 0.02;   // out-of-range slots (>= capacity, INT32_MAX, < -1)
  int empty_rows = 0;      // the first tokens: length 0, or full of -1, alternately
  uint64_t seed = 1;
  int max_gain_log2 = 1;   // q gains 2^-1 .. 2^max_gain_log2 per head
};

struct Cache {
  int entries_per_page = 64;
  int64_t num_pages = 0;
  std::vector<uint8_t> bytes;
  size_t stride() const { return fp8_ds_mla_page_stride(entries_per_page); }
  int64_t capacity() const { return num_pages * entries_per_page; }
};

struct HostCase {
  CaseSpec spec;
  std::vector<uint16_t> q;
  std::vector<float> sink;
  Cache swa, extra;
  std::vector<int32_t> swa_idx, swa_len, extra_idx, extra_len;
  float scale = 1.0f / std::sqrt(512.0f);

  SparseAttentionParams params() const {  // host pointers; out/lse left null
    SparseAttentionParams p;
    p.num_tokens = spec.tokens;
    p.num_heads = spec.heads;
    p.q = q.data();
    p.swa_cache = KvPages{swa.bytes.data(), swa.num_pages, swa.entries_per_page, swa.stride()};
    p.swa = IndexList{swa_idx.data(), swa_len.data(), spec.swa_width};
    if (spec.extra_width > 0) {
      p.extra_cache = KvPages{extra.bytes.data(), extra.num_pages, extra.entries_per_page, extra.stride()};
      p.extra = IndexList{extra_idx.data(), extra_len.data(), spec.extra_width};
    }
    p.attn_sink = sink.data();
    p.softmax_scale = scale;
    return p;
  }
};

// Fills one index list. Slots inside the lengths come from [0, referenced),
// the pool's referenced part, and get encoded; positions past the lengths
// point into the last page, which nothing references (NaN if ever read).
inline void fill_list(std::mt19937_64& rng, const CaseSpec& s, int width, Cache& cache, int64_t referenced,
                      std::vector<int32_t>& idx, std::vector<int32_t>& len, std::vector<char>& used) {
  idx.assign(size_t(s.tokens) * width, -1);
  len.assign(s.tokens, 0);
  std::uniform_real_distribution<double> u01(0.0, 1.0);
  std::uniform_int_distribution<int64_t> pick(0, referenced - 1);
  std::uniform_int_distribution<int64_t> unused(cache.capacity() - cache.entries_per_page, cache.capacity() - 1);
  for (int t = 0; t < s.tokens; ++t) {
    int n = s.ragged ? int(std::uniform_int_distribution<int>(0, width)(rng)) : width;
    const bool empty = t < s.empty_rows;
    if (empty) n = (t % 2 == 0) ? 0 : width;
    len[t] = n;
    for (int i = 0; i < width; ++i) {
      int32_t& slot = idx[size_t(t) * width + i];
      if (i >= n) {
        slot = int32_t(unused(rng));
        continue;
      }
      const double r = u01(rng);
      if (empty || r < s.hole_rate) {
        slot = -1;
      } else if (r < s.hole_rate + s.oor_rate) {
        const int kind = int(std::uniform_int_distribution<int>(0, 2)(rng));
        slot = kind == 0 ? int32_t(cache.capacity() + int64_t(rng() % 1000))
                         : (kind == 1 ? std::numeric_limits<int32_t>::max() : -2 - int32_t(rng() % 100));
      } else {
        slot = int32_t(pick(rng));
        used[size_t(slot)] = 1;
      }
    }
  }
}

// Encodes a random vector into every used entry: N(0,1) per dim (kv is
// RMS-normalised in the model, SPEC §4.2), with a power-of-two factor per
// 64-dim block so that several scale exponents occur.
inline void encode_used(std::mt19937_64& rng, Cache& cache, const std::vector<char>& used) {
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::uniform_int_distribution<int> ex(-2, 1);
  std::vector<float> kv(kKvDim);
  for (int64_t slot = 0; slot < cache.capacity(); ++slot) {
    if (!used[size_t(slot)]) continue;
    for (int b = 0; b < kKvDim / 64; ++b) {
      const float f = std::ldexp(1.0f, ex(rng));
      for (int d = 0; d < 64; ++d) kv[64 * b + d] = nd(rng) * f;
    }
    uint8_t* page = cache.bytes.data() + size_t(slot / cache.entries_per_page) * cache.stride();
    fp8_ds_mla_encode(kv.data(), page, cache.entries_per_page, int(slot % cache.entries_per_page));
  }
}

inline HostCase make_case(const CaseSpec& s) {
  HostCase c;
  c.spec = s;
  std::mt19937_64 rng(s.seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  c.q.resize(size_t(s.tokens) * s.heads * kKvDim);
  // q is RMS-normalised per head in the model (SPEC §4.1); per-head gains of
  // 0.5, 1 and 2 spread the softmax from flat to peaked (logits up to ~10).
  // Much larger logits would put lse where 1e-5 is a few float ulps, below
  // the rounding of fp32 tensor-core accumulation (see docs/perf-notes.md).
  std::vector<float> gain(s.heads);
  for (auto& g : gain) g = std::ldexp(1.0f, std::uniform_int_distribution<int>(-1, s.max_gain_log2)(rng));
  for (size_t i = 0; i < c.q.size(); ++i) c.q[i] = bf16_bits(nd(rng) * gain[(i / kKvDim) % s.heads]);
  c.sink.resize(s.heads);
  for (auto& v : c.sink) v = nd(rng);

  auto make_pool = [&](Cache& cache, int page, int width, std::vector<int32_t>& idx, std::vector<int32_t>& len) {
    cache.entries_per_page = page;
    // Referenced part: twice as many picks as slots (so about 13% of the
    // entries, spread among the used ones, stay unreferenced), capped to keep
    // host memory small, plus one never-referenced page.
    const int64_t picks = int64_t(s.tokens) * width;
    const int64_t referenced = std::clamp<int64_t>(picks / 2, std::max<int64_t>(2 * width, 4 * page), 262144);
    cache.num_pages = (referenced + page - 1) / page + 1;
    cache.bytes.assign(size_t(cache.num_pages) * cache.stride(), 0xFF);
    std::vector<char> used(size_t(cache.capacity()), 0);
    fill_list(rng, s, width, cache, referenced, idx, len, used);
    encode_used(rng, cache, used);
  };
  make_pool(c.swa, 64, s.swa_width, c.swa_idx, c.swa_len);
  if (s.extra_width > 0) make_pool(c.extra, s.extra_page, s.extra_width, c.extra_idx, c.extra_len);
  return c;
}

// The reference for all tokens, spread over threads.
struct Reference {
  std::vector<double> out, lse;
};

inline Reference reference(const SparseAttentionParams& p, const ReferenceOptions& opt = {}) {
  Reference r;
  r.out.resize(size_t(p.num_tokens) * p.num_heads * kKvDim);
  r.lse.resize(size_t(p.num_tokens) * p.num_heads);
  const int nt = std::max(1, std::min<int>(int(std::thread::hardware_concurrency()), 32));
  std::vector<std::thread> pool;
  for (int w = 0; w < nt; ++w)
    pool.emplace_back([&, w] {
      for (int t = w; t < p.num_tokens; t += nt)
        reference_sparse_attention_token(p, t, opt, r.out.data() + size_t(t) * p.num_heads * kKvDim,
                                         r.lse.data() + size_t(t) * p.num_heads);
    });
  for (auto& th : pool) th.join();
  return r;
}

// Device copies of a case plus output buffers. The outputs are followed by
// a guard of kGuardRows head rows that no call may write.
struct DeviceCase {
  static constexpr size_t kGuardRows = 64;
  std::vector<void*> ptrs;
  SparseAttentionParams p;  // device pointers
  size_t out_elems = 0, lse_elems = 0;

  template <typename T>
  T* upload(const std::vector<T>& v) {
    void* d = nullptr;
    if (cudaMalloc(&d, std::max<size_t>(1, v.size() * sizeof(T))) != cudaSuccess) return nullptr;
    ptrs.push_back(d);
    cudaMemcpy(d, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice);
    return static_cast<T*>(d);
  }
  explicit DeviceCase(const HostCase& c) {
    p = c.params();
    p.q = upload(c.q);
    p.attn_sink = upload(c.sink);
    p.swa_cache.base = upload(c.swa.bytes);
    p.swa.indices = upload(c.swa_idx);
    p.swa.lengths = upload(c.swa_len);
    if (c.spec.extra_width > 0) {
      p.extra_cache.base = upload(c.extra.bytes);
      p.extra.indices = upload(c.extra_idx);
      p.extra.lengths = upload(c.extra_len);
    }
    out_elems = size_t(c.spec.tokens) * c.spec.heads * kKvDim;
    lse_elems = size_t(c.spec.tokens) * c.spec.heads;
    p.out = upload(std::vector<uint16_t>(out_elems + kGuardRows * kKvDim));
    p.lse = upload(std::vector<float>(lse_elems + kGuardRows));
  }
  ~DeviceCase() {
    for (void* d : ptrs) cudaFree(d);
  }
  DeviceCase(const DeviceCase&) = delete;
  DeviceCase& operator=(const DeviceCase&) = delete;

  // 0xFF bytes: bf16 and float NaN, so an unwritten output cannot pass.
  void poison(cudaStream_t s = nullptr) const {
    cudaMemsetAsync(p.out, 0xFF, (out_elems + kGuardRows * kKvDim) * sizeof(uint16_t), s);
    cudaMemsetAsync(p.lse, 0xFF, (lse_elems + kGuardRows) * sizeof(float), s);
  }
  // Whether the guards behind the outputs still hold the poison.
  bool guards_intact() const {
    std::vector<uint16_t> o(kGuardRows * kKvDim);
    std::vector<uint32_t> l(kGuardRows);
    cudaMemcpy(o.data(), p.out + out_elems, o.size() * sizeof(uint16_t), cudaMemcpyDeviceToHost);
    cudaMemcpy(l.data(), p.lse + lse_elems, l.size() * sizeof(float), cudaMemcpyDeviceToHost);
    for (uint16_t v : o)
      if (v != 0xFFFF) return false;
    for (uint32_t v : l)
      if (v != 0xFFFFFFFFu) return false;
    return true;
  }
  void download(std::vector<uint16_t>& out, std::vector<float>& lse) const {
    out.assign(out_elems, 0xFFFF);  // NaN where a failed copy leaves nothing
    lse.assign(lse_elems, NAN);
    cudaMemcpy(out.data(), p.out, out_elems * sizeof(uint16_t), cudaMemcpyDeviceToHost);
    cudaMemcpy(lse.data(), p.lse, lse_elems * sizeof(float), cudaMemcpyDeviceToHost);
  }
  // One eager call on poisoned outputs: plan, run, wait, download.
  void plan_run_download(SparseAttentionCuda& attn, std::vector<uint16_t>& out, std::vector<float>& lse) const {
    poison();
    attn.plan(p, nullptr);
    attn.run(p, nullptr);
    const cudaError_t e = cudaDeviceSynchronize();
    EXPECT_EQ(e, cudaSuccess) << cudaGetErrorString(e);
    EXPECT_TRUE(guards_intact()) << "a call wrote past its outputs";
    download(out, lse);
  }
};

struct CompareStats {
  int rows = 0, bad_rows = 0, bad_lse = 0, nan_rows = 0;
  double max_rel = 0.0, max_lse_diff = 0.0, max_abs_lse = 0.0;
  std::string first_failure;
};

// Relative L2 per row <= tol_rel (an all-zero reference row needs an exactly
// zero output); lse within tol_lse absolute, -inf matching -inf.
inline CompareStats compare(const Reference& ref, const std::vector<uint16_t>& out, const std::vector<float>& lse,
                            int tokens, int heads, double tol_rel = 1e-2, double tol_lse = 1e-5) {
  CompareStats st;
  for (int t = 0; t < tokens; ++t) {
    for (int h = 0; h < heads; ++h) {
      const size_t row = size_t(t) * heads + h;
      double num = 0.0, den = 0.0;
      bool nan = false;
      for (int d = 0; d < kKvDim; ++d) {
        const double o = bf16_to_float(out[row * kKvDim + d]), r = ref.out[row * kKvDim + d];
        nan |= std::isnan(o);
        num += (o - r) * (o - r);
        den += r * r;
      }
      const double rel = den > 0.0 ? std::sqrt(num / den) : (num > 0.0 ? INFINITY : 0.0);
      ++st.rows;
      if (nan) ++st.nan_rows;
      if (nan || !(rel <= tol_rel)) {
        if (st.bad_rows++ == 0)
          st.first_failure = "token " + std::to_string(t) + " head " + std::to_string(h) + " rel " + std::to_string(rel);
      }
      if (!nan) st.max_rel = std::max(st.max_rel, rel);
      const double lr = ref.lse[row], lg = lse[row];
      const bool lse_ok = std::isinf(lr) ? (std::isinf(lg) && lg < 0) : std::fabs(lg - lr) <= tol_lse;
      if (!lse_ok) {
        if (st.bad_lse++ == 0 && st.first_failure.empty())
          st.first_failure = "lse token " + std::to_string(t) + " head " + std::to_string(h) + ": " +
                             std::to_string(lg) + " vs " + std::to_string(lr);
      }
      if (!std::isinf(lr) && std::isfinite(lg)) st.max_lse_diff = std::max(st.max_lse_diff, std::fabs(lg - lr));
      if (!std::isinf(lr)) st.max_abs_lse = std::max(st.max_abs_lse, std::fabs(lr));
    }
  }
  return st;
}

}  // namespace dsv4::test
