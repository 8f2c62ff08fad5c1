// The lightning indexer on both backends, same random inputs (test-backend-ops):
// the CUDA ops of attn/cuda/indexer_*_cuda.h against their CPU twins in
// attn/cpu/indexer_twin.h. Query records and head weights must match bit for bit;
// with MXFP4 keys so must the picks (order included), slots and lengths: the
// scorer computes the CPU's exact scores (see indexer_score.cu). With FP8 keys
// the tensor cores' fp32 accumulation may differ from the CPU's exact dot in
// the last bits, so picks are checked against the CPU's scores with a bound
// and their overlap is reported. GPU tests skip where no CUDA device is
// present. Outputs are poisoned before each run, every element must be
// written, and guard bytes behind every output must survive.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "support/cuda_device.h"
#include "attn/cpu/indexer_twin.h"
#include "attn/cuda/indexer_exact.cuh"
#include "attn/cuda/indexer_queries_cuda.h"
#include "attn/cuda/indexer_select_cuda.h"
#include "attn/cuda/indexer_topk.cuh"
#include "common/error.h"
#include "numerics/bf16.h"
#include "numerics/hadamard.h"
#include "numerics/quant.h"
#include "numerics/rope.h"

namespace dsv4::test {
namespace {

#define IX_CUDA_OK(expr)                                                                          \
  do {                                                                                            \
    const cudaError_t e_ = (expr);                                                                \
    if (e_ != cudaSuccess) throw Error(std::string(#expr) + ": " + cudaGetErrorString(e_));       \
  } while (0)

constexpr size_t kGuard = 4096;      // bytes checked behind every output
constexpr uint8_t kGuardByte = 0xcd;
constexpr uint8_t kPoisonByte = 0x5a;  // 0x5a5a5a5a is neither -1 nor a valid pick

// A device buffer with guard bytes behind it.
template <typename T>
struct DevBuf {
  T* ptr = nullptr;
  size_t n = 0;
  explicit DevBuf(size_t count) : n(count) {
    IX_CUDA_OK(cudaMalloc(&ptr, n * sizeof(T) + kGuard));
    IX_CUDA_OK(cudaMemset(reinterpret_cast<uint8_t*>(ptr) + n * sizeof(T), kGuardByte, kGuard));
  }
  DevBuf(const std::vector<T>& v) : DevBuf(v.size()) { upload(v); }
  ~DevBuf() { cudaFree(ptr); }
  DevBuf(const DevBuf&) = delete;
  DevBuf& operator=(const DevBuf&) = delete;
  void upload(const std::vector<T>& v) {
    IX_CUDA_OK(cudaMemcpy(ptr, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice));
  }
  void poison() { IX_CUDA_OK(cudaMemset(ptr, kPoisonByte, n * sizeof(T))); }
  std::vector<T> download() const {
    std::vector<T> v(n);
    IX_CUDA_OK(cudaMemcpy(v.data(), ptr, n * sizeof(T), cudaMemcpyDeviceToHost));
    return v;
  }
  bool guard_intact() const {
    std::vector<uint8_t> g(kGuard);
    IX_CUDA_OK(cudaMemcpy(g.data(), reinterpret_cast<uint8_t*>(ptr) + n * sizeof(T), kGuard, cudaMemcpyDeviceToHost));
    return std::all_of(g.begin(), g.end(), [](uint8_t b) { return b == kGuardByte; });
  }
};

uint32_t poison_word() { return 0x5a5a5a5au; }

class IndexerCudaTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!have_cuda_device()) GTEST_SKIP() << "no CUDA device";
  }
};

RopeFreqs c4a_rope() {
  return Rope(RopeParams{160000, true, YarnParams{}}).freqs();
}

// ---- op 1: queries -------------------------------------------------------------------

struct QueryInputs {
  int T = 0, nI = 64;
  std::vector<uint16_t> q_raw;
  std::vector<float> proj;
  std::vector<int32_t> positions;
};

QueryInputs random_query_inputs(int T, uint32_t seed) {
  QueryInputs in;
  in.T = T;
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::uniform_real_distribution<float> ud(-2.0f, 2.0f);
  in.q_raw.resize(size_t(T) * in.nI * kIndexDim);
  for (size_t i = 0; i < in.q_raw.size(); ++i) {
    const int head = int(i / kIndexDim) % in.nI;
    in.q_raw[i] = bf16_bits(nd(rng) * std::exp2(float(head % 7) - 3.0f));  // heads at different scales
  }
  in.proj.resize(size_t(T) * in.nI);
  for (auto& v : in.proj) v = nd(rng) * 4.0f;
  // Positions: 0, small, random, and the last positions of a 1M context.
  for (int t = 0; t < T; ++t) {
    int64_t p = int64_t(rng() % 1048576u);
    if (t % 5 == 0) p = 1048575 - t;
    if (t == 1) p = 0;
    if (t == 2) p = 3;
    in.positions.push_back(p);
  }
  return in;
}

struct QueryOutputs {
  std::vector<uint8_t> codes, scales;
  std::vector<float> weights;
};

QueryOutputs cpu_queries(const QueryInputs& in, IndexKeyFormat f) {
  QueryOutputs o;
  o.codes.assign(size_t(in.T) * in.nI * indexer_code_bytes(f), 0);
  o.scales.assign(size_t(in.T) * in.nI * kIndexerScaleBytes, 0);
  o.weights.assign(size_t(in.T) * in.nI, 0.0f);
  IndexerQueryParams p;
  p.num_tokens = in.T;
  p.num_heads = in.nI;
  p.q_raw = in.q_raw.data();
  p.q_ld = int64_t(in.nI) * kIndexDim;
  p.proj = in.proj.data();
  p.proj_ld = in.nI;
  p.positions = in.positions.data();
  p.rope = c4a_rope();
  p.out = IndexerQueriesOut{f, in.T, in.nI, o.codes.data(), o.scales.data(), o.weights.data()};
  indexer_queries_cpu(p);
  return o;
}

template <typename T>
int first_mismatch(const std::vector<T>& a, const std::vector<T>& b, size_t limit) {
  for (size_t i = 0; i < limit; ++i)
    if (std::memcmp(&a[i], &b[i], sizeof(T)) != 0) return int(i);
  return -1;
}

void check_queries(IndexKeyFormat f, int T, int real, uint32_t seed) {
  const QueryInputs in = random_query_inputs(T, seed);
  const QueryOutputs want = cpu_queries(in, f);
  DevBuf<uint16_t> q_raw(in.q_raw);
  DevBuf<float> proj(in.proj);
  DevBuf<int32_t> pos(in.positions);
  DevBuf<int32_t> real_d(std::vector<int32_t>{real});
  DevBuf<uint8_t> codes(want.codes.size()), scales(want.scales.size());
  DevBuf<float> weights(want.weights.size());
  codes.poison();
  scales.poison();
  weights.poison();
  IndexerQueryParams p;
  p.num_tokens = T;
  p.num_heads = in.nI;
  p.real_tokens = real < T ? real_d.ptr : nullptr;
  p.q_raw = q_raw.ptr;
  p.q_ld = int64_t(in.nI) * kIndexDim;
  p.proj = proj.ptr;
  p.proj_ld = in.nI;
  p.positions = pos.ptr;
  p.rope = c4a_rope();
  p.out = IndexerQueriesOut{f, T, in.nI, codes.ptr, scales.ptr, weights.ptr};
  indexer_queries_cuda(p, nullptr);
  IX_CUDA_OK(cudaDeviceSynchronize());
  const auto got_codes = codes.download(), got_scales = scales.download();
  const auto got_w = weights.download();
  const size_t per_token_codes = size_t(in.nI) * indexer_code_bytes(f), per_token_scales = size_t(in.nI) * 4;
  // Real rows bitwise; padded rows untouched (still poison).
  const int c = first_mismatch(got_codes, want.codes, size_t(real) * per_token_codes);
  EXPECT_EQ(c, -1) << "code byte " << c << " (token " << c / int(per_token_codes) << "): gpu " << int(got_codes[size_t(c)])
                   << " cpu " << int(want.codes[size_t(c)]);
  const int s = first_mismatch(got_scales, want.scales, size_t(real) * per_token_scales);
  EXPECT_EQ(s, -1) << "scale byte " << s << ": gpu " << int(got_scales[size_t(s)]) << " cpu " << int(want.scales[size_t(s)]);
  const int w = first_mismatch(got_w, want.weights, size_t(real) * in.nI);
  EXPECT_EQ(w, -1) << "weight " << w << ": gpu " << got_w[size_t(w)] << " cpu " << want.weights[size_t(w)];
  for (size_t i = size_t(real) * per_token_codes; i < got_codes.size(); ++i)
    ASSERT_EQ(got_codes[i], kPoisonByte) << "padded token's code byte " << i << " written";
  for (size_t i = size_t(real) * per_token_scales; i < got_scales.size(); ++i)
    ASSERT_EQ(got_scales[i], kPoisonByte) << "padded token's scale byte " << i << " written";
  for (size_t i = size_t(real) * in.nI; i < got_w.size(); ++i) {
    uint32_t u;
    std::memcpy(&u, &got_w[i], 4);
    ASSERT_EQ(u, poison_word()) << "padded token's weight " << i << " written";
  }
  // No NaN where the CPU has none; the records are fully written (no poison left in real rows
  // unless the CPU wrote the same byte, which the bitwise check covers).
  for (int i = 0; i < real * in.nI; ++i) ASSERT_FALSE(std::isnan(got_w[size_t(i)])) << "weight " << i;
  EXPECT_TRUE(codes.guard_intact() && scales.guard_intact() && weights.guard_intact()) << "write past an output";
}

TEST_F(IndexerCudaTest, QueriesMxfp4MatchCpuBitwise) { check_queries(IndexKeyFormat::kMxfp4, 53, 53, 101); }
TEST_F(IndexerCudaTest, QueriesFp8MatchCpuBitwise) { check_queries(IndexKeyFormat::kFp8, 53, 53, 102); }
TEST_F(IndexerCudaTest, QueriesSkipPaddedTokens) {
  check_queries(IndexKeyFormat::kMxfp4, 16, 11, 103);
  check_queries(IndexKeyFormat::kFp8, 16, 11, 104);
}

// The CPU twin's queries equal the layer's original composition: Rope::apply,
// bf16, Hadamard, bf16, the key codec's quantization (no device needed).
TEST(IndexerCpuTwin, QueriesEqualRopeHadamardAndTheKeyCodec) {
  const QueryInputs in = random_query_inputs(9, 105);
  const Rope rope(RopeParams{160000, true, YarnParams{}});
  for (IndexKeyFormat f : {IndexKeyFormat::kMxfp4, IndexKeyFormat::kFp8}) {
    const QueryOutputs got = cpu_queries(in, f);
    const int cb = indexer_code_bytes(f);
    std::vector<uint8_t> page(size_t(cb + 4));
    for (int t = 0; t < in.T; ++t)
      for (int h = 0; h < in.nI; ++h) {
        float x[kIndexDim];
        const size_t e = size_t(t) * in.nI + h;
        for (int i = 0; i < kIndexDim; ++i) x[i] = bf16_to_float(in.q_raw[e * kIndexDim + i]);
        rope.apply(x + 64, in.positions[size_t(t)]);
        round_bf16(x + 64, 64);
        hadamard_rotate(x, kIndexDim);
        round_bf16(x, kIndexDim);
        index_key_encode(f, x, page.data(), 1, 0);
        ASSERT_EQ(std::memcmp(page.data(), got.codes.data() + e * cb, size_t(cb)), 0) << "token " << t << " head " << h;
        ASSERT_EQ(std::memcmp(page.data() + cb, got.scales.data() + e * 4, 4), 0) << "token " << t << " head " << h;
        const float w = round_bf16(round_bf16(in.proj[e]) * float(1.0 / std::sqrt(128.0) / std::sqrt(64.0)));
        ASSERT_EQ(got.weights[e], w);
      }
  }
}

// ---- op 2: selection ------------------------------------------------------------------

struct RunSpec {
  int64_t first_pos = 0;  // position of the run's first token
  int tokens = 1;
  int first_block = 0;    // table column 0 = this logical block (earlier keys have no page)
};

// A step's selection inputs on the host: runs, positions, block tables, key
// pages (random keys) and query records (from random q_raw via the CPU twin).
struct World {
  IndexKeyFormat format = IndexKeyFormat::kMxfp4;
  int topk = 512, T = 0, width = 1;
  std::vector<int32_t> positions;
  std::vector<int32_t> token_run;
  std::vector<int32_t> pages, first;
  int64_t num_pages = 0;
  size_t stride = 0;
  std::vector<uint8_t> pool;      // num_pages * stride bytes (host)
  std::vector<int64_t> used;      // pages holding keys
  QueryOutputs q;

  KvPages host_keys() const { return KvPages{pool.data(), num_pages, kIndexerKeysPerPage, stride}; }
  BlockTableView host_table() const { return BlockTableView{pages.data(), first.data(), width, kIndexerKeysPerPage}; }
  IndexerQueries host_queries() const {
    return IndexerQueries{format, T, 64, q.codes.data(), q.scales.data(), q.weights.data()};
  }
};

struct WorldOptions {
  int64_t page_offset = 0;  // first page id handed out (big: byte offsets past 2^31)
  double slow_key_rate = 0;  // MXFP4 keys with a block 2^5 below the others (the exact path)
  double odd_key_rate = 0;   // MXFP4 keys with blocks of zero codes or NaN scales (odd_key below)
  // > 0: tokens 0, n, 2n, ... have queries 2^-20 of the others' and head 0
  // weighted 2^-106, the rest 0 (outside the fast path, and past what its
  // scaling keeps exact: the CPU's terms are near 2^-126, many subnormal)
  int odd_weight_every = 0;
  // > 0: tokens 1, 1 + n, ... have queries 2^-20 of the others' and every
  // head weight at 2^-48 (the fast path's bound) times 1..1.875
  int small_weights_every = 0;
  int duplicate_every = 0;   // > 0: every key j with j % this != 0 copies key j - j % this (exact ties)
  bool one_key = false;      // every key of a run is its first key (one score)
  // > 0: as one_key, then key j scaled by 2^(j / rising_every) (scale bytes
  // or factors: exact), so the scores rise or fall with j in steps, tied
  // within a step
  int rising_every = 0;
  // > 0: keys of tiles j / 64 % n == 0 copy the key its run's first token
  // scores highest, the others have zero codes (score 0): that token's best
  // keys are those tiles' in index order (ties to the lower key)
  int hot_tile_every = 0;
  uint32_t seed = 1;
};

// Key j of a run: a random 128-vector with per-block magnitudes 2^0..2^2
// (MXFP4 blocks 0..2 binades apart: fold shifts 0..2), quantized by the codec.
void random_key(std::mt19937& rng, IndexKeyFormat f, bool slow, uint8_t* page, int t) {
  std::normal_distribution<float> nd(0.0f, 1.0f);
  float v[kIndexDim];
  const float key_scale = std::exp2(float(int(rng() % 9)) - 4.0f);
  for (int b = 0; b < 4; ++b) {
    const float s = key_scale * std::exp2(float(rng() % 3)) * (slow && b == 3 ? 1.0f / 64 : 1.0f);
    for (int i = 0; i < 32; ++i) v[32 * b + i] = nd(rng) * s;
  }
  index_key_encode(f, v, page, kIndexerKeysPerPage, t);
}

// Rewrites an MXFP4 record (key t of the page) in one of four odd ways the
// fast path's fold must tell apart: (0) a block of zero codes whose scale
// byte is far from the others' (it must not count), (1) every code zero (no
// block counts), (2) a NaN (0xff) scale byte (the exact path), (3) a zero
// block with a NaN scale (the exact path: the CPU's dot sees the NaN).
void odd_key(std::mt19937& rng, uint8_t* page, int t) {
  constexpr int cb = kIndexDim / 2;
  uint8_t* codes = page + size_t(cb) * t;
  uint8_t* scales = page + size_t(cb) * kIndexerKeysPerPage + 4 * size_t(t);
  const int kind = int(rng() % 4), b = int(rng() % 4);
  static constexpr uint8_t kFar[] = {0x00, 0x01, 0x20, 0xe0, 0xfe};
  if (kind == 1) {
    std::memset(codes, 0, cb);
    return;
  }
  if (kind != 2) std::memset(codes + 16 * b, 0, 16);
  scales[b] = kind == 0 ? kFar[rng() % 5] : 0xff;
}

// Scales a key record by 2^e through its scale part (4 bytes: MXFP4's UE8M0
// block exponents, FP8's fp32 factor): exact, and its scores scale alike.
void rise(IndexKeyFormat f, uint8_t* scales, int e) {
  if (f == IndexKeyFormat::kMxfp4) {
    for (int b = 0; b < 4; ++b) {
      ASSERT_LT(int(scales[b]) + e, 0xff) << "a UE8M0 exponent past the finite range";
      scales[b] = uint8_t(scales[b] + e);
    }
    return;
  }
  float s;
  std::memcpy(&s, scales, 4);
  s = std::ldexp(s, e);
  std::memcpy(scales, &s, 4);
}

// WorldOptions::hot_tile_every: per run, the key its first token scores
// highest is copied to every key of the hot tiles; the other keys' codes
// are zeroed.
void make_hot_tiles(World& w, int every) {
  const int cb = indexer_code_bytes(w.format), sb = kIndexerScaleBytes;
  auto page_of = [&](int run, int64_t j) {  // key j's page: 64 keys' codes, then their scales
    const int64_t page = w.pages[size_t(run) * size_t(w.width) + size_t(j / 64 - w.first[size_t(run)])];
    return w.pool.data() + size_t(page) * w.stride;
  };
  auto codes_of = [&](int run, int64_t j) { return page_of(run, j) + size_t(cb) * size_t(j % 64); };
  auto scale_of = [&](int run, int64_t j) { return page_of(run, j) + size_t(cb) * 64 + size_t(sb) * size_t(j % 64); };
  for (int t = 0; t < w.T;) {
    const int run = w.token_run[size_t(t)], t0 = t;
    while (t < w.T && w.token_run[size_t(t)] == run) ++t;  // (a run's tokens are consecutive)
    const int64_t first = int64_t(w.first[size_t(run)]) * 64, n0 = indexer_visible(w.positions[size_t(t0)]);
    const int64_t end = (indexer_visible(w.positions[size_t(t - 1)]) + 63) / 64 * 64;  // the run's pages
    std::vector<float> scores(static_cast<size_t>(n0));
    indexer_scores_cpu(w.host_queries(), t0, w.host_table(), run, w.host_keys(), n0, scores.data());
    int64_t best = first;
    for (int64_t j = first; j < n0; ++j)
      if (scores[size_t(j)] > scores[size_t(best)]) best = j;
    ASSERT_GT(scores[size_t(best)], 0.0f) << "run " << run;
    const std::vector<uint8_t> codes(codes_of(run, best), codes_of(run, best) + cb);
    const std::vector<uint8_t> scale(scale_of(run, best), scale_of(run, best) + sb);
    for (int64_t j = first; j < end; ++j) {
      if (j / 64 % every != 0) {
        std::memset(codes_of(run, j), 0, size_t(cb));
        continue;
      }
      std::memcpy(codes_of(run, j), codes.data(), size_t(cb));
      std::memcpy(scale_of(run, j), scale.data(), size_t(sb));
    }
  }
}

World make_world(IndexKeyFormat f, int topk, const std::vector<RunSpec>& runs, const WorldOptions& opt) {
  World w;
  w.format = f;
  w.topk = topk;
  w.stride = index_key_page_stride(f, kIndexerKeysPerPage);
  std::mt19937 rng(opt.seed);
  // Pages per run: the blocks from first_block up to the last token's visible keys.
  std::vector<int64_t> blocks;
  int64_t total = 0;
  for (const RunSpec& r : runs) {
    const int64_t n = indexer_visible(r.first_pos + r.tokens - 1);
    const int64_t b = std::max<int64_t>(0, (n + 63) / 64 - r.first_block);
    blocks.push_back(b);
    total += b;
    w.width = std::max<int>(w.width, int(b) + 1);  // one spare column (-1)
  }
  w.num_pages = opt.page_offset + total + 3;  // a few never-used pages
  w.pool.assign(size_t(w.num_pages) * w.stride, 0);
  std::vector<int64_t> ids(static_cast<size_t>(total));
  std::iota(ids.begin(), ids.end(), opt.page_offset);
  std::shuffle(ids.begin(), ids.end(), rng);
  w.pages.assign(runs.size() * size_t(w.width), -1);
  w.first.assign(runs.size(), 0);
  size_t next = 0;
  for (size_t r = 0; r < runs.size(); ++r) {
    w.first[r] = runs[r].first_block;
    for (int64_t b = 0; b < blocks[r]; ++b) {
      const int64_t page = ids[next++];
      w.pages[r * size_t(w.width) + size_t(b)] = int32_t(page);
      w.used.push_back(page);
      uint8_t* base = w.pool.data() + size_t(page) * w.stride;
      for (int t = 0; t < kIndexerKeysPerPage; ++t) {
        const bool slow = f == IndexKeyFormat::kMxfp4 && std::generate_canonical<double, 32>(rng) < opt.slow_key_rate;
        random_key(rng, f, slow, base, t);
        if (f == IndexKeyFormat::kMxfp4 && std::generate_canonical<double, 32>(rng) < opt.odd_key_rate)
          odd_key(rng, base, t);
      }
      const bool one = opt.one_key || opt.rising_every > 0;
      if (opt.duplicate_every > 0 || one) {  // copy records within the page: equal keys, equal scores
        const int cb = indexer_code_bytes(f);
        const int64_t run_first_page = w.pages[r * size_t(w.width)];  // one_key: every record copies its run's first
        const uint8_t* from = one ? w.pool.data() + size_t(run_first_page) * w.stride : base;
        for (int t = 0; t < kIndexerKeysPerPage; ++t) {
          const int src = one ? 0 : t - t % opt.duplicate_every;
          std::memcpy(base + size_t(cb) * t, from + size_t(cb) * src, size_t(cb));
          std::memcpy(base + size_t(cb) * 64 + 4 * t, from + size_t(cb) * 64 + 4 * src, 4);
          if (opt.rising_every > 0)
            rise(f, base + size_t(cb) * 64 + 4 * t, int(((runs[r].first_block + b) * 64 + t) / opt.rising_every));
        }
      }
    }
    for (int i = 0; i < runs[r].tokens; ++i) {
      w.positions.push_back(runs[r].first_pos + i);
      w.token_run.push_back(int32_t(r));
    }
  }
  w.T = int(w.positions.size());
  QueryInputs qi = random_query_inputs(w.T, opt.seed + 7);
  qi.positions = w.positions;
  // The odd and small-weight tokens: queries scaled by 2^-20 (exact), then their head weights.
  const auto each = [&](int first, int every, auto&& fn) {
    for (int t = first; every > 0 && t < w.T; t += every) fn(t);
  };
  const auto tiny_queries = [&](int t) {
    uint16_t* q = qi.q_raw.data() + size_t(t) * 64 * kIndexDim;
    for (int i = 0; i < 64 * kIndexDim; ++i) q[i] = bf16_bits(bf16_to_float(q[i]) * 0x1p-20f);
  };
  each(0, opt.odd_weight_every, tiny_queries);
  each(1, opt.small_weights_every, tiny_queries);
  w.q = cpu_queries(qi, f);
  float* weights = w.q.weights.data();
  each(0, opt.odd_weight_every, [&](int t) {
    for (int h = 0; h < 64; ++h) weights[size_t(t) * 64 + size_t(h)] = h == 0 ? 0x1p-106f : 0.0f;
  });
  each(1, opt.small_weights_every, [&](int t) {  // mixed signs: head sums that cancel to far smaller values
    for (int h = 0; h < 64; ++h)
      weights[size_t(t) * 64 + size_t(h)] = (h % 2 ? -1.0f : 1.0f) * (1.0f + float(h % 8) / 8) * 0x1p-48f;
  });
  if (opt.hot_tile_every > 0) make_hot_tiles(w, opt.hot_tile_every);
  return w;
}

struct Selection {
  std::vector<int32_t> picks, slots, lengths;
};

IndexerSelectParams host_params(const World& w, Selection& out) {
  out.picks.assign(size_t(w.T) * w.topk, 0);
  out.slots.assign(size_t(w.T) * w.topk, 0);
  out.lengths.assign(size_t(w.T), 0);
  IndexerSelectParams p;
  p.num_tokens = w.T;
  p.positions = w.positions.data();
  p.token_run = w.token_run.data();
  p.c4a_table = w.host_table();
  p.keys = w.host_keys();
  p.queries = w.host_queries();
  p.topk = w.topk;
  p.picks = out.picks.data();
  p.slots = out.slots.data();
  p.lengths = out.lengths.data();
  return p;
}

Selection cpu_select(const World& w) {
  Selection s;
  indexer_select_cpu(host_params(w, s));
  return s;
}

// The world on the device and the GPU op's outputs.
struct DeviceWorld {
  DevBuf<int32_t> positions;
  DevBuf<int32_t> token_run, pages, first, real;
  DevBuf<uint8_t> pool, qcodes, qscales;
  DevBuf<float> qweights;
  DevBuf<int32_t> picks, slots, lengths;
  const World& w;
  explicit DeviceWorld(const World& world, int real_tokens = -1)
      : positions(world.positions), token_run(world.token_run), pages(world.pages), first(world.first),
        real(std::vector<int32_t>{real_tokens}), pool(world.pool.size()), qcodes(world.q.codes),
        qscales(world.q.scales), qweights(world.q.weights), picks(size_t(world.T) * world.topk),
        slots(size_t(world.T) * world.topk), lengths(size_t(world.T)), w(world) {
    for (int64_t page : world.used)  // only the pages holding keys travel
      IX_CUDA_OK(cudaMemcpy(pool.ptr + size_t(page) * world.stride, world.pool.data() + size_t(page) * world.stride,
                            world.stride, cudaMemcpyHostToDevice));
  }
  IndexerSelectParams params(bool padded) const {
    IndexerSelectParams p;
    p.num_tokens = w.T;
    p.real_tokens = padded ? real.ptr : nullptr;
    p.positions = positions.ptr;
    p.token_run = token_run.ptr;
    p.c4a_table = BlockTableView{pages.ptr, first.ptr, w.width, kIndexerKeysPerPage};
    p.keys = KvPages{pool.ptr, w.num_pages, kIndexerKeysPerPage, w.stride};
    p.queries = IndexerQueries{w.format, w.T, 64, qcodes.ptr, qscales.ptr, qweights.ptr};
    p.topk = w.topk;
    p.picks = picks.ptr;
    p.slots = slots.ptr;
    p.lengths = lengths.ptr;
    return p;
  }
  // planned: run_planned on the plan of an earlier op.plan() call.
  Selection run(IndexerSelectCuda& op, bool padded = false, bool planned = false,
                IndexerGrouping grouping = IndexerGrouping::kRuns) {
    return collect([&] {
      if (planned)
        op.run_planned(params(padded), nullptr);
      else
        op.run(params(padded), nullptr, grouping);
    });
  }
  Selection run_short(IndexerSelectCuda& op, bool padded = false) {
    return collect([&] { op.run_short(params(padded), nullptr); });
  }
  // The outputs of launch() (poisoned before, guards checked after).
  template <typename Launch>
  Selection collect(Launch&& launch) {
    picks.poison();
    slots.poison();
    lengths.poison();
    launch();
    IX_CUDA_OK(cudaDeviceSynchronize());
    Selection s{picks.download(), slots.download(), lengths.download()};
    EXPECT_TRUE(picks.guard_intact() && slots.guard_intact() && lengths.guard_intact()) << "write past an output";
    return s;
  }
};

// Every element written; lengths = the number of picks; slots = block_table_slot of the picks.
void check_well_formed(const World& w, const Selection& g, int real) {
  const BlockTableView tb = w.host_table();
  for (int t = 0; t < w.T; ++t) {
    const int len = g.lengths[size_t(t)];
    ASSERT_NE(uint32_t(len), poison_word()) << "length of token " << t << " not written";
    const int64_t visible = t < real ? indexer_visible(w.positions[size_t(t)]) : 0;
    ASSERT_TRUE(len >= 0 && len <= std::min<int64_t>(w.topk, visible)) << "token " << t << " length " << len;
    std::set<int32_t> seen;
    for (int i = 0; i < w.topk; ++i) {
      const int32_t j = g.picks[size_t(t) * w.topk + size_t(i)], s = g.slots[size_t(t) * w.topk + size_t(i)];
      if (i < len) {
        ASSERT_TRUE(j >= 0 && j < visible) << "token " << t << " pick " << i << " = " << j;
        ASSERT_TRUE(seen.insert(j).second) << "token " << t << " picks " << j << " twice";
        ASSERT_EQ(s, block_table_slot(tb, w.token_run[size_t(t)], j)) << "token " << t << " slot of pick " << i;
      } else {
        ASSERT_EQ(j, -1) << "token " << t << " pick " << i << " beyond length " << len;
        ASSERT_EQ(s, -1) << "token " << t << " slot " << i << " beyond length " << len;
      }
    }
  }
}

// MXFP4: the same picks in the same order, slots and lengths, bit for bit.
void expect_identical(const World& w, const Selection& want, const Selection& got) {
  for (int t = 0; t < w.T; ++t) {
    ASSERT_EQ(got.lengths[size_t(t)], want.lengths[size_t(t)]) << "token " << t << " length";
    for (int i = 0; i < w.topk; ++i) {
      const size_t k = size_t(t) * w.topk + size_t(i);
      ASSERT_EQ(got.picks[k], want.picks[k]) << "token " << t << " (position " << w.positions[size_t(t)] << ") pick "
                                             << i << ": gpu " << got.picks[k] << " cpu " << want.picks[k];
      ASSERT_EQ(got.slots[k], want.slots[k]) << "token " << t << " slot " << i;
    }
  }
}

// FP8: lengths equal; every pick the GPU and the CPU disagree on scores within
// `tol` of the CPU's k-th score (scores from the CPU twin). The bound: the
// tensor cores' fp32 accumulation of e4m3 products truncates below about
// 2^-13 of the largest partial sum (13-bit accumulator mantissa), so a dot is
// off by a few 2^-10 of sum |q_i k_i| at most; after the bf16 roundings a
// term moves by at most ~2 bf16 ulps (2^-7 relative) and the score by about
// 2^-7 of the terms' magnitudes plus one ulp. For the keys near the top,
// whose terms are mostly positive, that magnitude is the size of the top
// score, so tol = 2^-5 * max_j |score_j| leaves a margin of 4 and still
// rejects a wrong layout or scale (those give unrelated picks and an overlap
// far below the bound checked by the caller). Returns the overlap.
double expect_close(const World& w, const Selection& want, const Selection& got) {
  int64_t same = 0, total = 0;
  for (int t = 0; t < w.T; ++t) {
    const int len = want.lengths[size_t(t)];
    EXPECT_EQ(got.lengths[size_t(t)], len) << "token " << t;
    if (len == 0) continue;
    std::set<int32_t> a(want.picks.begin() + int64_t(t) * w.topk, want.picks.begin() + int64_t(t) * w.topk + len);
    std::set<int32_t> b(got.picks.begin() + int64_t(t) * w.topk, got.picks.begin() + int64_t(t) * w.topk + len);
    total += len;
    int common = 0;
    for (int32_t j : b) common += a.count(j) ? 1 : 0;
    same += common;
    if (common == len) continue;
    const int64_t n = indexer_visible(w.positions[size_t(t)]);
    std::vector<float> scores(static_cast<size_t>(n));
    indexer_scores_cpu(w.host_queries(), t, w.host_table(), w.token_run[size_t(t)], w.host_keys(), n, scores.data());
    float scale = 0.0f;  // max_j sum_h |term_h|, bounded by sum_h |w_h| * max |dot| ... taken from the scores
    for (float s : scores)
      if (!std::isnan(s)) scale = std::max(scale, std::fabs(s));
    const float kth = scores[size_t(want.picks[size_t(t) * w.topk + size_t(len - 1)])];
    const float tol = std::ldexp(scale, -5);
    for (int32_t j : b)
      if (!a.count(j))
        EXPECT_GE(scores[size_t(j)], kth - tol) << "token " << t << ": gpu picked " << j << " (cpu score "
                                                << scores[size_t(j)] << ") below the cpu's k-th " << kth;
    for (int32_t j : a)
      if (!b.count(j))
        EXPECT_LE(scores[size_t(j)], kth + tol) << "token " << t << ": gpu dropped " << j << " (cpu score "
                                                << scores[size_t(j)] << ") well above the cpu's k-th " << kth;
  }
  return total ? double(same) / double(total) : 1.0;
}

void compare(const World& w, const Selection& want, const Selection& got, int real) {
  check_well_formed(w, got, real);
  if (::testing::Test::HasFatalFailure()) return;  // a pick out of range would index the scores below
  if (w.format == IndexKeyFormat::kMxfp4) {
    expect_identical(w, want, got);
  } else {
    const double overlap = expect_close(w, want, got);
    std::printf("    fp8 keys: top-k overlap with the cpu %.6f\n", overlap);
    ::testing::Test::RecordProperty("topk_overlap", std::to_string(overlap));
    EXPECT_GE(overlap, 0.95);
  }
}

// Both groupings: the general score kernel (runs of up to 4 tokens per
// group) and the decode kernel (one token per group), each against the CPU.
constexpr IndexerGrouping kGroupings[] = {IndexerGrouping::kRuns, IndexerGrouping::kOneTokenPerRun};
const char* grouping_name(IndexerGrouping g) { return g == IndexerGrouping::kRuns ? "by runs" : "one token per group"; }

// Whether run_short takes the world's step (a decode step of short rows).
bool short_fits(const World& w) {
  int64_t last = 0;
  for (int t = 0; t < w.T; ++t) {
    if (t > 0 && w.token_run[size_t(t)] == w.token_run[size_t(t - 1)]) return false;  // a run of two tokens
    last = std::max<int64_t>(last, w.positions[size_t(t)]);
  }
  return indexer_short_select_fits(w.T, last);
}

// Every grouping against the CPU; where the step is a short decode step,
// run_short too, and bit for bit as the decode kernel and finalize.
void run_case(IndexKeyFormat f, int topk, const std::vector<RunSpec>& runs, const WorldOptions& opt = {},
              int work_units = 0) {
  const World w = make_world(f, topk, runs, opt);
  const Selection want = cpu_select(w);
  DeviceWorld dw(w);
  IndexerSelectCuda op({w.T, topk, work_units});
  if (short_fits(w)) {
    SCOPED_TRACE("run_short");
    const Selection got = dw.run_short(op);
    compare(w, want, got, w.T);
    expect_identical(w, dw.run(op, false, false, IndexerGrouping::kOneTokenPerRun), got);
    std::printf("    %s topk %d, run_short: %d tokens\n", std::string(index_key_format_name(f)).c_str(), topk, w.T);
  }
  for (IndexerGrouping grouping : kGroupings) {
    SCOPED_TRACE(grouping_name(grouping));
    const Selection got = dw.run(op, false, false, grouping);
    compare(w, want, got, w.T);
    int picked = 0;
    for (int len : got.lengths) picked += len;
    std::printf("    %s topk %d, %s: %d tokens, %d picks, workspace %.1f MB\n",
                std::string(index_key_format_name(f)).c_str(), topk, grouping_name(grouping), w.T, picked,
                double(op.workspace_bytes()) / 1e6);
  }
}

// Decode: one token per run, contexts from nothing visible to 70K positions.
std::vector<RunSpec> decode_runs() {
  std::vector<RunSpec> r;
  for (int64_t pos : {70000, 2, 3, 4095, 2047, 16383, 5000, 700, 2048 + 7, 1999, 30000, 9})
    r.push_back(RunSpec{pos, 1, 0});
  return r;
}

// Prefill chunks (several runs, different contexts) with a decode token.
// A short decode step (run_short's): 16 tokens from no visible key to 4,096
// (position 16,383, the kernel's last), below, at and above topk.
std::vector<RunSpec> short_decode_runs() {
  std::vector<RunSpec> r;
  for (int64_t pos : {700, 2, 4095, 0, 16383, 2047, 9, 12000, 2055, 1, 5000, 3, 8190, 1999, 6000, 4})
    r.push_back(RunSpec{pos, 1, 0});
  return r;
}

std::vector<RunSpec> prefill_runs() {
  return {RunSpec{5000, 300, 0}, RunSpec{0, 77, 0}, RunSpec{2301, 6, 0}, RunSpec{40000, 1, 0}, RunSpec{8190, 129, 0}};
}

TEST_F(IndexerCudaTest, DecodeMxfp4Top512) { run_case(IndexKeyFormat::kMxfp4, 512, decode_runs()); }
TEST_F(IndexerCudaTest, DecodeFp8Top512) { run_case(IndexKeyFormat::kFp8, 512, decode_runs()); }
TEST_F(IndexerCudaTest, DecodeMxfp4Top1024) { run_case(IndexKeyFormat::kMxfp4, 1024, decode_runs(), {.seed = 3}); }
TEST_F(IndexerCudaTest, PrefillMxfp4Top512) { run_case(IndexKeyFormat::kMxfp4, 512, prefill_runs(), {.seed = 4}); }
TEST_F(IndexerCudaTest, PrefillFp8Top1024) { run_case(IndexKeyFormat::kFp8, 1024, prefill_runs(), {.seed = 5}); }

// Fewer visible keys than topk, and none at all (positions 0..2).
TEST_F(IndexerCudaTest, VisibleBelowTopkAndZero) {
  const std::vector<RunSpec> runs = {RunSpec{0, 40, 0}, RunSpec{1, 1, 0}, RunSpec{130, 3, 0}, RunSpec{2000, 1, 0}};
  run_case(IndexKeyFormat::kMxfp4, 512, runs, {.seed = 6});
  run_case(IndexKeyFormat::kFp8, 512, runs, {.seed = 7});
}

// Groups of equal keys: exact score ties, broken towards the lower j on both sides.
TEST_F(IndexerCudaTest, ExactTiesGoToTheLowerKey) {
  const std::vector<RunSpec> runs = {RunSpec{9000, 5, 0}, RunSpec{3000, 1, 0}};
  run_case(IndexKeyFormat::kMxfp4, 512, runs, {.duplicate_every = 4, .seed = 8});
  run_case(IndexKeyFormat::kMxfp4, 64, runs, {.duplicate_every = 64, .seed = 9});  // whole pages tie
}

// Every key of a run equal (one score, ties to the lower j): the lists'
// bound then keeps nearly every key, more than finalize stages, and it
// selects from the lists in global memory.
TEST_F(IndexerCudaTest, AllKeysTiePastTheStage) {
  run_case(IndexKeyFormat::kMxfp4, 512, {RunSpec{40000, 1, 0}, RunSpec{20000, 2, 0}},
           {.one_key = true, .seed = 15});
}

// Scores that rise (or fall) with the key in steps of 1,024 keys, tied
// within a step: nearly every listed key passes the lists' bound, as in
// decode after a real prefill (docs/perf-notes.md, run AU3), and finalize
// refines it from the lists' first keys (refine_bound) before it selects.
TEST_F(IndexerCudaTest, RisingScoresRefineTheBound) {
  const std::vector<RunSpec> runs = {RunSpec{65535, 1, 0}, RunSpec{40000, 2, 0}};
  run_case(IndexKeyFormat::kMxfp4, 512, runs, {.rising_every = 1024, .seed = 31});
  run_case(IndexKeyFormat::kMxfp4, 1024, runs, {.rising_every = 1024, .seed = 32});
  run_case(IndexKeyFormat::kFp8, 512, runs, {.rising_every = 1024, .seed = 33});
}

// Keys whose MXFP4 blocks span more than 3 binades take the exact scalar path.
TEST_F(IndexerCudaTest, WideBlockScalesTakeTheExactPath) {
  run_case(IndexKeyFormat::kMxfp4, 512, {RunSpec{20000, 3, 0}, RunSpec{7000, 1, 0}}, {.slow_key_rate = 0.002, .seed = 10});
}

// Head weights at the fast path's lower bound (2^-48, see weight_ok): the
// smallest terms and their sums must still round as the CPU's.
TEST_F(IndexerCudaTest, HeadWeightsAtTheFastPathsBound) {
  run_case(IndexKeyFormat::kMxfp4, 512, prefill_runs(), {.small_weights_every = 3, .seed = 28});
  run_case(IndexKeyFormat::kMxfp4, 512, {RunSpec{20000, 1, 0}, RunSpec{9000, 3, 0}}, {.small_weights_every = 1, .seed = 29});
  run_case(IndexKeyFormat::kFp8, 512, {RunSpec{20000, 3, 0}, RunSpec{7000, 1, 0}}, {.small_weights_every = 2, .seed = 30});
}

// A query head whose weight is outside the fast path's range: that token's
// scores take the exact path, its group's other tokens stay on the fast one.
TEST_F(IndexerCudaTest, OneTokenOffTheFastPath) {
  run_case(IndexKeyFormat::kMxfp4, 512, prefill_runs(), {.odd_weight_every = 7, .seed = 25});
  run_case(IndexKeyFormat::kMxfp4, 512, {RunSpec{20000, 1, 0}, RunSpec{7000, 1, 0}, RunSpec{9000, 3, 0}},
           {.odd_weight_every = 2, .seed = 26});
  run_case(IndexKeyFormat::kFp8, 512, {RunSpec{20000, 3, 0}, RunSpec{7000, 1, 0}}, {.odd_weight_every = 3, .seed = 27});
}

// Blocks of zero codes (which the fold skips, whatever their scale), keys of
// zero codes only, and NaN scales (the exact path): still bit for bit.
TEST_F(IndexerCudaTest, ZeroBlocksAndNanScales) {
  run_case(IndexKeyFormat::kMxfp4, 512, {RunSpec{20000, 3, 0}, RunSpec{7000, 1, 0}}, {.odd_key_rate = 0.05, .seed = 24});
}

__global__ void fp8_dot_exact_kernel(const uint8_t* q, const float* qs, const uint8_t* k, const float* ks, float* out,
                                     int n) {
  const int i = int(blockIdx.x * blockDim.x + threadIdx.x);
  if (i < n) out[i] = cuda::ix::fp8_dot_exact(q + size_t(i) * kIndexDim, qs[i], k + size_t(i) * kIndexDim, ks[i]);
}

// The exact path's FP8 dot on the device (indexer_exact.cuh) against the CPU
// twin's indexer_fp8_dot, bit for bit: every pair of codes alone in a record
// (subnormals, NaN, both zeros), then random records (NaN codes in some),
// records of the largest codes (a sum past 2^32), and scales of either kind.
TEST_F(IndexerCudaTest, ExactFp8DotMatchesTheCpu) {
  std::vector<uint8_t> q, k;
  std::vector<float> qs, ks;
  std::mt19937 rng(31);
  auto add = [&](const uint8_t* qa, const uint8_t* ka, float sq, float sk) {
    q.insert(q.end(), qa, qa + kIndexDim);
    k.insert(k.end(), ka, ka + kIndexDim);
    qs.push_back(sq);
    ks.push_back(sk);
  };
  uint8_t a[kIndexDim], b[kIndexDim];
  for (int x = 0; x < 256; ++x)
    for (int y = 0; y < 256; ++y) {
      std::fill(a, a + kIndexDim, uint8_t(0));
      std::fill(b, b + kIndexDim, uint8_t((x + y) & 1 ? 0x80 : 0));  // -0 in half of them
      a[(x + y) % kIndexDim] = uint8_t(x);
      b[(x + y) % kIndexDim] = uint8_t(y);
      add(a, b, 0x1p-6f, 0x1p-6f);
    }
  const float scales[] = {0x1p-6f, 0x1p-40f, 0x1p+40f, 1.37f, 1e-40f, 3.0e+20f};
  for (int r = 0; r < 8192; ++r) {
    for (int i = 0; i < kIndexDim; ++i) {
      a[i] = uint8_t(rng());
      b[i] = uint8_t(rng());
      if (r % 16 != 0) {  // NaN codes (0x7f, 0xff) only in every 16th record
        if ((a[i] & 0x7f) == 0x7f) a[i] ^= 1;
        if ((b[i] & 0x7f) == 0x7f) b[i] ^= 1;
      }
    }
    if (r % 64 == 1) {  // the largest magnitude everywhere, one sign: |S| = 128 * 229376^2
      std::fill(a, a + kIndexDim, uint8_t(0x7e));
      std::fill(b, b + kIndexDim, uint8_t(r % 128 == 1 ? 0xfe : 0x7e));
    }
    add(a, b, scales[r % 6], scales[(r / 6) % 6]);
  }
  const int n = int(qs.size());
  DevBuf<uint8_t> dq(q), dk(k);
  DevBuf<float> dqs(qs), dks(ks), dout(static_cast<size_t>(n));
  dout.poison();
  fp8_dot_exact_kernel<<<unsigned((n + 127) / 128), 128>>>(dq.ptr, dqs.ptr, dk.ptr, dks.ptr, dout.ptr, n);
  IX_CUDA_OK(cudaGetLastError());
  IX_CUDA_OK(cudaDeviceSynchronize());
  const std::vector<float> got = dout.download();
  int nans = 0;
  for (int i = 0; i < n; ++i) {
    const float want = indexer_fp8_dot(&q[size_t(i) * kIndexDim], qs[size_t(i)], &k[size_t(i) * kIndexDim], ks[size_t(i)]);
    nans += std::isnan(want);
    ASSERT_EQ(std::bit_cast<uint32_t>(got[size_t(i)]), std::bit_cast<uint32_t>(want))
        << "record " << i << ": device " << got[size_t(i)] << " cpu " << want;
  }
  EXPECT_TRUE(dout.guard_intact());
  std::printf("    %d records, %d of them NaN on both sides\n", n, nans);
}

constexpr int kCutThreads = 128, kCutPerThread = 12;  // a warpgroup and its 1,536-key buffer, as compact()

// Case c: its keys keys[c][0 .. kCutThreads * kCutPerThread) (0 = empty),
// the threshold radix_kth gives for k[c] and slack[c], over one warpgroup.
__global__ void radix_cut_kernel(const uint64_t* keys, const uint32_t* k, const uint32_t* slack, uint64_t* out) {
  __shared__ uint32_t hist[256], sel[2];
  const uint64_t* mine = keys + size_t(blockIdx.x) * kCutThreads * kCutPerThread;
  uint64_t v[kCutPerThread];
  for (int i = 0; i < kCutPerThread; ++i) v[i] = mine[threadIdx.x + kCutThreads * i];
  const uint64_t t = cuda::ix::radix_kth<8, false>(
      [&](auto&& f) {
        for (int i = 0; i < kCutPerThread; ++i) f(v[i]);
      },
      k[blockIdx.x], hist, sel, int(threadIdx.x), kCutThreads, [] { __syncthreads(); }, slack[blockIdx.x]);
  if (threadIdx.x == 0) out[blockIdx.x] = t;
}

// The score kernel's cut (compact) keeps the keys at or above radix_kth's
// threshold: with slack s, k to k + s of them; with none, exactly k. Keys of
// the order-key form (bit 34 set, unique): random bits, a few scores with
// random indices (many keys share their leading digits, as a unit's
// candidates do), and consecutive values; buffers full and part full.
TEST_F(IndexerCudaTest, RadixCutKeepsKToKPlusSlack) {
  constexpr int kPer = kCutThreads * kCutPerThread;
  std::mt19937_64 rng(41);
  std::vector<uint64_t> keys;
  std::vector<uint32_t> ks, slacks;
  for (int kind = 0; kind < 3; ++kind)
    for (int n : {kPer, 1217, 600})
      for (uint32_t k : {1u, 100u, 512u, 600u, 1024u})
        for (uint32_t slack : {0u, 1u, 7u, 64u, 176u, 1000u}) {
          if (int(k) > n) continue;
          std::set<uint64_t> set;
          const uint64_t base = uint64_t(rng() % (1u << 20)) << 14;
          while (int(set.size()) < n) {
            const uint64_t r = rng();
            const uint64_t low = kind == 0   ? r & ((uint64_t(1) << 34) - 1)                             // random bits
                                 : kind == 1 ? ((0x8000u + r % 12) << 18) | ((r >> 32) & 0x3ffffu)  // 12 scores
                                             : base + set.size();                                    // consecutive
            set.insert((uint64_t(1) << 34) | low);
          }
          std::vector<uint64_t> c(set.begin(), set.end());
          std::shuffle(c.begin(), c.end(), rng);
          c.resize(kPer, 0);
          std::shuffle(c.begin(), c.end(), rng);  // the empty slots anywhere
          keys.insert(keys.end(), c.begin(), c.end());
          ks.push_back(k);
          slacks.push_back(slack);
        }
  const int cases = int(ks.size());
  DevBuf<uint64_t> dkeys(keys), dout(static_cast<size_t>(cases));
  DevBuf<uint32_t> dk(ks), dslack(slacks);
  dout.poison();
  radix_cut_kernel<<<unsigned(cases), kCutThreads>>>(dkeys.ptr, dk.ptr, dslack.ptr, dout.ptr);
  IX_CUDA_OK(cudaGetLastError());
  IX_CUDA_OK(cudaDeviceSynchronize());
  const std::vector<uint64_t> got = dout.download();
  int loose = 0;
  for (int c = 0; c < cases; ++c) {
    const uint64_t* kc = &keys[size_t(c) * kPer];
    const uint32_t kept = uint32_t(std::count_if(kc, kc + kPer, [&](uint64_t x) { return x != 0 && x >= got[size_t(c)]; }));
    ASSERT_GE(kept, ks[size_t(c)]) << "case " << c << ": slack " << slacks[size_t(c)];
    ASSERT_LE(kept, ks[size_t(c)] + slacks[size_t(c)]) << "case " << c << ": k " << ks[size_t(c)];
    ASSERT_GT(got[size_t(c)], 0u) << "case " << c;
    loose += kept > ks[size_t(c)];
  }
  EXPECT_TRUE(dout.guard_intact());
  std::printf("    %d cases, %d of them kept more than k\n", cases, loose);
}

// Table rows that start at a later block: the earlier keys have no page and are never picked.
TEST_F(IndexerCudaTest, KeysWithoutPagesAreSkipped) {
  run_case(IndexKeyFormat::kMxfp4, 512, {RunSpec{20000, 2, 30}, RunSpec{5000, 1, 3}}, {.seed = 11});
}

// The longest context: 262,144 keys (positions up to 1,048,575), both topk.
TEST_F(IndexerCudaTest, LongContext262kKeys) {
  const std::vector<RunSpec> runs = {RunSpec{1048575, 1, 0}, RunSpec{1048572, 4, 0}};
  run_case(IndexKeyFormat::kMxfp4, 1024, runs, {.seed = 12});
  run_case(IndexKeyFormat::kFp8, 512, {RunSpec{1048575, 1, 0}}, {.seed = 13});
}

// Units long enough that a warpgroup's candidate buffer (1,536 keys in the
// decode kernel; 1,280 in the general one with MXFP4 keys, 1,152 with FP8
// keys, above top-512 1,536 and 1,408) fills and is cut to the best k (or a
// few more), more than once: with two units of
// work, the 64K-context token's 256 tiles make one unit, 64 tiles per
// warpgroup of the decode kernel and 85-86 of the general one's three (its
// groups of 2 tokens cut too).
TEST_F(IndexerCudaTest, LongUnitsCutTheirBuffers) {
  const std::vector<RunSpec> runs = {RunSpec{65535, 1, 0}, RunSpec{50001, 2, 0}};
  run_case(IndexKeyFormat::kMxfp4, 512, runs, {.seed = 19}, 2);
  run_case(IndexKeyFormat::kMxfp4, 1024, runs, {.seed = 20}, 2);
  run_case(IndexKeyFormat::kFp8, 512, runs, {.seed = 23}, 2);
  run_case(IndexKeyFormat::kFp8, 1024, runs, {.seed = 24}, 2);
}

// Every 12th tile holds the best keys of its run's first token, all equal
// (so in index order), the rest score 0. With a unit that starts at tile 0
// those tiles are the first warpgroup's in both scorers (3 and 4
// warpgroups): its buffer holds all of the token's final picks when it is
// cut, so a cut that kept fewer than k would lose some. (A cut to k - slack
// passed every other test: run AO6's mutation M1.)
TEST_F(IndexerCudaTest, CutsKeepAllKWhereOneWarpgroupHoldsThePicks) {
  const std::vector<RunSpec> runs = {RunSpec{65535, 1, 0}, RunSpec{50001, 2, 0}};
  run_case(IndexKeyFormat::kMxfp4, 512, runs, {.hot_tile_every = 12, .seed = 26}, 2);
  run_case(IndexKeyFormat::kFp8, 512, runs, {.hot_tile_every = 12, .seed = 27}, 2);
}

// Pages whose byte offset passes 2^31 (64-bit page arithmetic).
TEST_F(IndexerCudaTest, PagesBeyond2GiB) {
  const int64_t mx = (int64_t(1) << 31) / int64_t(index_key_page_stride(IndexKeyFormat::kMxfp4, 64)) + 100;
  run_case(IndexKeyFormat::kMxfp4, 512, {RunSpec{6000, 2, 0}, RunSpec{3000, 1, 0}}, {.page_offset = mx, .seed = 14});
  const int64_t f8 = (int64_t(1) << 31) / int64_t(index_key_page_stride(IndexKeyFormat::kFp8, 64)) + 100;
  run_case(IndexKeyFormat::kFp8, 512, {RunSpec{6000, 2, 0}}, {.page_offset = f8, .seed = 15});
}

// run() three more times gives the bits of its first run, and so does
// launch(stream) captured in a CUDA graph and replayed on poisoned outputs.
template <typename Run, typename Launch>
void expect_repeatable(DeviceWorld& dw, Run&& run, Launch&& launch) {
  const Selection first = run();
  for (int rep = 0; rep < 3; ++rep) {
    const Selection again = run();
    ASSERT_EQ(again.picks, first.picks) << "run " << rep;
    ASSERT_EQ(again.slots, first.slots) << "run " << rep;
    ASSERT_EQ(again.lengths, first.lengths) << "run " << rep;
  }
  cudaStream_t stream;
  IX_CUDA_OK(cudaStreamCreate(&stream));
  dw.picks.poison();
  dw.slots.poison();
  dw.lengths.poison();
  cudaGraph_t graph;
  IX_CUDA_OK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  launch(stream);
  IX_CUDA_OK(cudaStreamEndCapture(stream, &graph));
  cudaGraphExec_t exec;
  IX_CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
  IX_CUDA_OK(cudaGraphLaunch(exec, stream));
  IX_CUDA_OK(cudaStreamSynchronize(stream));
  EXPECT_EQ(dw.picks.download(), first.picks);
  EXPECT_EQ(dw.slots.download(), first.slots);
  EXPECT_EQ(dw.lengths.download(), first.lengths);
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
}

// run_short (one kernel for a short decode step) against the CPU and the
// decode kernel with finalize, on both key formats and both topk; then on
// the odd inputs of the tests above: ties, keys without pages, the exact
// path, pages past 2 GiB, one score for every key.
TEST_F(IndexerCudaTest, ShortDecodeMatchesTheCpuAndTheDecodeKernels) {
  run_case(IndexKeyFormat::kMxfp4, 512, short_decode_runs(), {.seed = 40});
  run_case(IndexKeyFormat::kFp8, 512, short_decode_runs(), {.seed = 41});
  run_case(IndexKeyFormat::kMxfp4, 1024, short_decode_runs(), {.seed = 42});
  run_case(IndexKeyFormat::kFp8, 1024, {RunSpec{16383, 1, 0}, RunSpec{9000, 1, 0}}, {.seed = 43});
}
TEST_F(IndexerCudaTest, ShortDecodeOddInputs) {
  const std::vector<RunSpec> runs = {RunSpec{16383, 1, 0}, RunSpec{3000, 1, 0}, RunSpec{9000, 1, 0}};
  run_case(IndexKeyFormat::kMxfp4, 512, runs, {.duplicate_every = 4, .seed = 44});
  run_case(IndexKeyFormat::kMxfp4, 64, runs, {.duplicate_every = 64, .seed = 45});
  run_case(IndexKeyFormat::kMxfp4, 512, runs, {.one_key = true, .seed = 46});
  run_case(IndexKeyFormat::kMxfp4, 512, runs, {.rising_every = 256, .seed = 47});
  run_case(IndexKeyFormat::kMxfp4, 512, {RunSpec{16000, 1, 30}, RunSpec{5000, 1, 3}}, {.seed = 48});
  run_case(IndexKeyFormat::kMxfp4, 512, runs, {.slow_key_rate = 0.01, .seed = 49});
  run_case(IndexKeyFormat::kMxfp4, 512, runs, {.odd_key_rate = 0.02, .seed = 50});
  run_case(IndexKeyFormat::kMxfp4, 512, runs, {.odd_weight_every = 2, .seed = 51});
  run_case(IndexKeyFormat::kFp8, 512, runs, {.small_weights_every = 2, .seed = 52});
  const int64_t mx = (int64_t(1) << 31) / int64_t(index_key_page_stride(IndexKeyFormat::kMxfp4, 64)) + 100;
  run_case(IndexKeyFormat::kMxfp4, 512, runs, {.page_offset = mx, .seed = 53});
}

// run_short: padded tokens (garbage positions and runs) get -1 rows and
// length 0 and read nothing; a token past the kernel's 4,096 keys (a step
// the backend would not route here) gets an empty row, the others theirs.
TEST_F(IndexerCudaTest, ShortDecodePaddedAndTooLongRows) {
  World w = make_world(IndexKeyFormat::kMxfp4, 512,
                       {RunSpec{9000, 1, 0}, RunSpec{16387, 1, 0}, RunSpec{300, 1, 0}, RunSpec{4000, 1, 0},
                        RunSpec{7000, 1, 0}}, {.seed = 54});
  const int real = 4;
  w.positions[4] = INT32_MAX;
  w.token_run[4] = 1 << 20;  // no such table row
  World cpu_world = w;
  cpu_world.T = real;
  cpu_world.positions.resize(size_t(real));
  cpu_world.token_run.resize(size_t(real));
  const Selection want = cpu_select(cpu_world);
  DeviceWorld dw(w, real);
  IndexerSelectCuda op({w.T, 512});
  const Selection got = dw.run_short(op, true);
  for (int t = 0; t < w.T; ++t) {
    const bool empty = t == 1 || t >= real;
    ASSERT_EQ(got.lengths[size_t(t)], empty ? 0 : want.lengths[size_t(t)]) << "token " << t;
    for (int i = 0; i < w.topk; ++i) {
      const size_t k = size_t(t) * w.topk + size_t(i);
      ASSERT_EQ(got.picks[k], empty ? -1 : want.picks[k]) << "token " << t << " pick " << i;
      ASSERT_EQ(got.slots[k], empty ? -1 : want.slots[k]) << "token " << t << " slot " << i;
    }
  }
}

// run_short: the same bits run after run and from a CUDA graph; it refuses
// more tokens than it takes.
TEST_F(IndexerCudaTest, ShortDecodeDeterministicGraphedAndBounded) {
  for (IndexKeyFormat f : {IndexKeyFormat::kMxfp4, IndexKeyFormat::kFp8}) {
    const World w = make_world(f, 512, short_decode_runs(), {.seed = 55});
    DeviceWorld dw(w);
    IndexerSelectCuda op({w.T, 512});
    expect_repeatable(
        dw, [&] { return dw.run_short(op); }, [&](cudaStream_t stream) { op.run_short(dw.params(false), stream); });
  }
  std::vector<RunSpec> runs(size_t(kShortSelectMaxTokens) + 1, RunSpec{100, 1, 0});
  const World many = make_world(IndexKeyFormat::kMxfp4, 512, runs, {.seed = 56});
  DeviceWorld dm(many);
  IndexerSelectCuda op({many.T, 512});
  EXPECT_THROW(op.run_short(dm.params(false), nullptr), Error);
}

// Padded tokens (a device-side count): -1 rows and length 0; their positions
// and runs are garbage that must not be read.
TEST_F(IndexerCudaTest, PaddedTokensReadNothing) {
  World w = make_world(IndexKeyFormat::kMxfp4, 512, {RunSpec{9000, 1, 0}, RunSpec{4000, 2, 0}, RunSpec{7000, 3, 0}}, {.seed = 16});
  const int real = 3;
  for (int t = real; t < w.T; ++t) {
    w.positions[size_t(t)] = INT32_MAX;
    w.token_run[size_t(t)] = 1 << 20;  // no such table row
  }
  World cpu_world = w;
  cpu_world.T = real;  // the CPU twin sees only the real tokens
  cpu_world.positions.resize(size_t(real));
  cpu_world.token_run.resize(size_t(real));
  const Selection want = cpu_select(cpu_world);
  DeviceWorld dw(w, real);
  IndexerSelectCuda op({w.T, 512});
  for (IndexerGrouping grouping : kGroupings) {
    SCOPED_TRACE(grouping_name(grouping));
    const Selection got = dw.run(op, true, false, grouping);
    check_well_formed(w, got, real);
    for (int t = 0; t < w.T; ++t) {
      if (t >= real) {
        ASSERT_EQ(got.lengths[size_t(t)], 0) << "padded token " << t;
        continue;
      }
      ASSERT_EQ(got.lengths[size_t(t)], want.lengths[size_t(t)]) << "token " << t;
      for (int i = 0; i < w.topk; ++i)
        ASSERT_EQ(got.picks[size_t(t) * w.topk + size_t(i)], want.picks[size_t(t) * w.topk + size_t(i)]) << "token " << t;
    }
  }
}

// One plan serves several layers: the same tokens with other keys and
// queries, run after run (the score's unit counter must start over each time).
TEST_F(IndexerCudaTest, OnePlanServesEveryLayer) {
  const std::vector<RunSpec> runs = prefill_runs();
  const World a = make_world(IndexKeyFormat::kMxfp4, 512, runs, {.seed = 21});
  const World b = make_world(IndexKeyFormat::kMxfp4, 512, runs, {.seed = 22});
  ASSERT_EQ(a.positions, b.positions);
  ASSERT_EQ(a.token_run, b.token_run);
  DeviceWorld da(a), db(b);
  IndexerSelectCuda op({a.T, 512});
  const Selection want_a = cpu_select(a), want_b = cpu_select(b);
  for (IndexerGrouping grouping : kGroupings) {
    SCOPED_TRACE(grouping_name(grouping));
    op.plan(da.params(false), nullptr, grouping);  // run_planned keeps the plan's grouping
    for (int layer = 0; layer < 3; ++layer) {
      const Selection got_a = da.run(op, false, true);
      compare(a, want_a, got_a, a.T);
      const Selection got_b = db.run(op, false, true);
      compare(b, want_b, got_b, b.T);
      ASSERT_NE(got_a.picks, got_b.picks) << "layer " << layer << ": the two worlds must differ";
    }
  }
}

// Same inputs, same bits: repeated runs and a CUDA-graph replay.
TEST_F(IndexerCudaTest, DeterministicAndGraphCapturable) {
  for (IndexKeyFormat f : {IndexKeyFormat::kMxfp4, IndexKeyFormat::kFp8})
  for (IndexerGrouping grouping : kGroupings) {
    SCOPED_TRACE(grouping_name(grouping));
    const World w = make_world(f, 512, prefill_runs(), {.seed = 17});
    DeviceWorld dw(w);
    IndexerSelectCuda op({w.T, 512});
    expect_repeatable(
        dw, [&] { return dw.run(op, false, false, grouping); },
        [&](cudaStream_t stream) { op.run(dw.params(false), stream, grouping); });
  }
}

// Host-side checks throw before anything launches.
TEST_F(IndexerCudaTest, BadParamsThrow) {
  const World w = make_world(IndexKeyFormat::kMxfp4, 512, {RunSpec{300, 1, 0}}, {.seed = 18});
  DeviceWorld dw(w);
  IndexerSelectCuda op({w.T, 512});
  IndexerSelectParams p = dw.params(false);
  p.queries.num_heads = 32;
  EXPECT_THROW(op.run(p, nullptr), Error);
  p = dw.params(false);
  p.topk = 1025;
  EXPECT_THROW(op.run(p, nullptr), Error);
  IndexerSelectCuda small({w.T, 256});
  EXPECT_THROW(small.run(dw.params(false), nullptr), Error);  // topk beyond the limits
  p = dw.params(false);
  p.num_tokens = w.T + 1;
  EXPECT_THROW(op.run(p, nullptr), Error);
  EXPECT_THROW(IndexerSelectCuda({w.T, 512, -1}), Error);  // negative work units
}

}  // namespace
}  // namespace dsv4::test
