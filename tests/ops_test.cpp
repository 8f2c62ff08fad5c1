// Each CPU op against a brute-force version of its definition (SPEC §4).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "attn/cpu/attend.h"
#include "attn/cpu/indexer.h"
#include "numerics/rmsnorm.h"
#include "numerics/rope.h"
#include "runtime/engine.h"
#include "support/random.h"

using namespace dsv4;

TEST(TopK, MatchesAFullSortWithTiesToTheLowerSlot) {
  std::mt19937 rng(1);
  for (int trial = 0; trial < 50; ++trial) {
    const int n = 1 + int(rng() % 300), k = 1 + int(rng() % 80);
    std::vector<float> s(static_cast<size_t>(n));
    for (auto& v : s) v = float(int(rng() % 20));  // many ties
    std::vector<int32_t> order(static_cast<size_t>(n));
    for (int i = 0; i < n; ++i) order[size_t(i)] = i;
    std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return s[size_t(a)] > s[size_t(b)]; });
    order.resize(size_t(std::min(n, k)));
    EXPECT_EQ(top_k(s.data(), n, k), order);
  }
}

TEST(Attend, MatchesDenseMaskedSoftmaxWithSink) {
  const int H = 4, N = 37, D = 512;
  const auto q = randn(size_t(H) * D, 2, 0.05f), keys = randn(size_t(N) * D, 3), sink = randn(H, 4);
  std::vector<float> out(size_t(H) * D), lse(H), scratch(size_t(H) * N);
  const float scale = 1.0f / std::sqrt(512.0f);
  attend_heads(q.data(), H, keys.data(), N, sink.data(), AttendOptions{scale, false}, out.data(), lse.data(),
               scratch.data());
  // Dense attention over a longer sequence where a mask hides what is not selected.
  for (int h = 0; h < H; ++h) {
    std::vector<double> s(N);
    double mx = sink[size_t(h)];
    for (int i = 0; i < N; ++i) {
      double d = 0;
      for (int e = 0; e < D; ++e) d += double(q[size_t(h) * D + e]) * keys[size_t(i) * D + e];
      s[size_t(i)] = d * scale;
      mx = std::max(mx, s[size_t(i)]);
    }
    double den = std::exp(sink[size_t(h)] - mx), sum = 0;
    for (double v : s) den += std::exp(v - mx), sum += std::exp(v - mx);
    EXPECT_NEAR(lse[size_t(h)], mx + std::log(sum), 1e-5);
    for (int e = 0; e < D; e += 7) {
      double o = 0;
      for (int i = 0; i < N; ++i) o += std::exp(s[size_t(i)] - mx) / den * keys[size_t(i) * D + e];
      EXPECT_NEAR(out[size_t(h) * D + e], o, 1e-5);
    }
  }
  // Nothing attended: zero output, -inf lse.
  attend_heads(q.data(), H, keys.data(), 0, sink.data(), AttendOptions{scale, false}, out.data(), lse.data(),
               scratch.data());
  for (float v : out) ASSERT_EQ(v, 0.0f);
  EXPECT_EQ(lse[0], -std::numeric_limits<float>::infinity());
}

namespace {

// A mini engine (exact profile, synthetic weights) with one request prefilled
// in uneven chunks: the compressors and indexer ran over chunk boundaries.
struct MiniStack {
  ModelConfig c = preset_config("mini");
  std::unique_ptr<Engine> engine;
  std::vector<float> x;  // [L, D] inputs of every position
  int64_t length = 0;
  std::vector<LayerCapture> last;  // per layer, the last step's capture

  MiniStack(int64_t total, std::vector<int> chunks, int key_tile = 2048) {
    EngineOptions eo;
    eo.profile = Profile::kExact;
    eo.indexer_key_tile = key_tile;
    eo.workload = CacheWorkload{2, total, 1024};
    engine = Engine::from_seed(c, 7, eo);
    x = randn(size_t(total) * c.hidden_size, 8);
    engine->open_request(0);
    for (int len : chunks) step(len);
  }
  void step(int len) {
    std::vector<RunError> errors;
    const StepMetadata s = engine->plan({{0, length, len}}, errors);
    ASSERT_TRUE(errors.empty());
    last.assign(size_t(c.num_layers), {});
    const std::span<const float> in(x.data() + size_t(length) * c.hidden_size, size_t(len) * c.hidden_size);
    engine->forward_layers(s, in, true, [&](int l, std::span<const float>, const LayerCapture* cap) {
      last[size_t(l)] = *cap;
    });
    engine->commit(s);
    length += len;
  }
};

// v = sum_i softmax_i(g) a_i over the pooled tokens, channel by channel (SPEC §4.3).
std::vector<double> direct_pool(const CompressorWeights& w, const std::vector<float>& x, int D, int64_t j) {
  const int m = w.ratio, c = w.dim, kc = w.coff * c;
  const auto wkv = w.wkv.dequantize(), wg = w.wgate.dequantize();
  std::vector<double> v(static_cast<size_t>(c));
  for (int e = 0; e < c; ++e) {
    std::vector<std::pair<double, double>> ag;  // (a, g) of each pooled token
    const int64_t first = m == 4 ? std::max<int64_t>(0, (j - 1) * m) : j * m;
    for (int64_t p = first; p < j * m + m; ++p) {
      const int col = (m == 4 && p >= j * m) ? c + e : e;
      double a = 0, g = w.ape[size_t(p % m) * kc + col];
      for (int d = 0; d < D; ++d) {
        a += double(wkv[size_t(col) * D + d]) * x[size_t(p) * D + d];
        g += double(wg[size_t(col) * D + d]) * x[size_t(p) * D + d];
      }
      ag.emplace_back(a, g);
    }
    double mx = -1e300, den = 0, num = 0;
    for (auto [a, g] : ag) mx = std::max(mx, g);
    for (auto [a, g] : ag) den += std::exp(g - mx), num += std::exp(g - mx) * a;
    v[size_t(e)] = num / den;
  }
  return v;
}

}  // namespace

// The pooled entry, normalized and rotated as SPEC §4.3 says.
std::vector<float> direct_entry(const CompressorWeights& w, const ModelConfig& c, const std::vector<float>& x,
                                int64_t j) {
  const std::vector<double> v = direct_pool(w, x, c.hidden_size, j);
  std::vector<float> f(v.begin(), v.end());
  rms_norm(f.data(), w.norm.data(), w.dim, float(c.rms_norm_eps), f.data());
  Rope(c.rope_params(LayerType::kC4A)).apply(f.data() + w.dim - kRopeDim, j * w.ratio);
  return f;
}

TEST(Compressor, C4AEntriesMatchTheDirectFormulaAcrossChunks) {
  MiniStack st(300, {5, 2, 130, 35, 127});  // chunk boundaries inside blocks
  st.step(1);                               // position 299 completes C4A slot 74
  const LayerWeights w = random_layer_weights(st.c, 1, 7, st.c.fp8_weights);
  ASSERT_EQ(st.last[1].compressed_tokens, std::vector<int>{0});
  const auto want = direct_entry(*w.compressor, st.c, st.x, 74);
  for (int e = 0; e < 512; ++e) EXPECT_NEAR(st.last[1].compressed[size_t(e)], want[size_t(e)], 2e-5) << e;
  const auto want_key = direct_entry(w.indexer->compressor, st.c, st.x, 74);
  for (int e = 0; e < 128; ++e) EXPECT_NEAR(st.last[1].index_keys[size_t(e)], want_key[size_t(e)], 2e-5) << e;
}

TEST(Compressor, C128AEntryMatchesTheDirectFormulaAcrossChunks) {
  MiniStack st(256, {100, 100, 55});
  st.step(1);  // position 255 completes C128A slot 1: tokens 128..255 came in three chunks
  const LayerWeights w = random_layer_weights(st.c, 2, 7, st.c.fp8_weights);
  ASSERT_EQ(st.last[2].compressed_tokens, std::vector<int>{0});
  const auto want = direct_entry(*w.compressor, st.c, st.x, 1);
  for (int e = 0; e < 512; ++e) EXPECT_NEAR(st.last[2].compressed[size_t(e)], want[size_t(e)], 2e-5) << e;
}

TEST(Indexer, PicksMatchBruteForceScoresAndAFullSort) {
  MiniStack st(400, {260, 139});
  st.step(1);  // position 399: 100 visible C4A slots, top 64 of them
  const LayerWeights w = random_layer_weights(st.c, 1, 7, st.c.fp8_weights);
  const IndexerWeights& iw = *w.indexer;
  // Inputs of the query: c_q = RMSNorm(x wq_a^T; q_norm), as the layer computes it.
  const int D = st.c.hidden_size, R = st.c.q_lora_rank, nI = st.c.index_n_heads;
  const float* x = st.x.data() + size_t(399) * D;
  const auto wq_a = w.wq_a.dequantize(), wq_b = iw.wq_b.dequantize(), wp = iw.weights_proj.dequantize();
  std::vector<float> cq(static_cast<size_t>(R));
  for (int r = 0; r < R; ++r) {
    double a = 0;
    for (int d = 0; d < D; ++d) a += double(wq_a[size_t(r) * D + d]) * x[d];
    cq[size_t(r)] = float(a);
  }
  rms_norm(cq.data(), w.q_norm.data(), R, 1e-6f, cq.data());
  const Rope rope(st.c.rope_params(LayerType::kC4A));
  std::vector<std::vector<float>> keys;
  for (int64_t j = 0; j < 100; ++j) keys.push_back(direct_entry(iw.compressor, st.c, st.x, j));
  std::vector<float> scores(100, 0.0f);
  for (int h = 0; h < nI; ++h) {
    std::vector<float> qh(128);
    for (int e = 0; e < 128; ++e) {
      double a = 0;
      for (int r = 0; r < R; ++r) a += double(wq_b[size_t(h * 128 + e) * R + r]) * cq[size_t(r)];
      qh[size_t(e)] = float(a);
    }
    rope.apply(qh.data() + 64, 399);
    double wh = 0;
    for (int d = 0; d < D; ++d) wh += double(wp[size_t(h) * D + d]) * x[d];
    wh /= std::sqrt(128.0) * std::sqrt(double(nI));
    for (int j = 0; j < 100; ++j) {
      double dot = 0;
      for (int e = 0; e < 128; ++e) dot += double(qh[size_t(e)]) * keys[size_t(j)][size_t(e)];
      scores[size_t(j)] += float(wh * std::max(dot, 0.0));
    }
  }
  std::vector<int32_t> order(100);
  for (int j = 0; j < 100; ++j) order[size_t(j)] = j;
  std::sort(order.begin(), order.end(), [&](int a, int b) { return scores[size_t(a)] > scores[size_t(b)]; });
  order.resize(64);
  std::vector<int32_t> got = st.last[1].topk.at(0);
  ASSERT_EQ(got.size(), 64u);
  // Float noise can swap picks whose scores tie to ~1e-6; demand the set except for such near-ties.
  std::sort(got.begin(), got.end());
  std::vector<int32_t> want = order;
  std::sort(want.begin(), want.end());
  int differ = 0;
  for (int32_t j : got)
    if (!std::binary_search(want.begin(), want.end(), j)) {
      ++differ;
      EXPECT_NEAR(scores[size_t(j)], scores[size_t(order.back())], 1e-4f) << "slot " << j;
    }
  EXPECT_LE(differ, 1);
}

TEST(Indexer, StreamingKeyTilesPickWhatOneTilePicks) {
  // 150 visible slots scored in one tile, or in tiles of 7: the same top 64.
  MiniStack one(600, {300}), tiled(600, {300}, 7);
  one.step(299), tiled.step(299);
  ASSERT_EQ(one.last[1].topk.size(), 299u);
  for (size_t t = 0; t < 299; ++t) ASSERT_EQ(one.last[1].topk[t], tiled.last[1].topk[t]) << t;
}
