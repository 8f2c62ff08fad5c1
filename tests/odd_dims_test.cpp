// The exact profile on a configuration the reference accepts but whose widths
// are not multiples of 128 (hidden 320, q_lora_rank 160, o_groups *
// o_lora_rank 160), through every CPU path that reads those widths: the
// config, synthetic weights with partial FP8 blocks, Linear, and whole layers.
// The layers are checked against the same model zero-padded to 128-multiples
// (hidden 384, o_lora_rank 128), whose exact-profile math is the same sums
// with zeros added: the outputs must agree to float32 rounding.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <random>

#include "attn/cpu/linear.h"
#include "model/config.h"
#include "model/weights.h"
#include "numerics/bf16.h"
#include "runtime/engine.h"
#include "support/error_of.h"
#include "support/random.h"

namespace dsv4 {
namespace {

// mini's structure (SWA-only, C4A, C128A; 4 heads, 2 output groups) at odd widths.
ModelConfig odd_config(int hidden = 320, int o_lora = 80) {
  ModelConfig c = preset_config("mini");
  c.name = "odd";
  c.hidden_size = hidden;
  c.q_lora_rank = 160;
  c.o_lora_rank = o_lora;
  c.validate();
  return c;
}

WeightMatrix bf16_matrix(const std::vector<float>& values, int64_t rows, int64_t cols) {
  WeightMatrix m;
  m.name.assign(1, 'w');  // (assigning a literal trips GCC 12's -Wrestrict)
  m.rows = rows, m.cols = cols;
  m.dtype = DType::kBF16;
  m.owned.resize(size_t(rows * cols) * 2);
  for (size_t i = 0; i < values.size(); ++i) {
    const uint16_t b = bf16_bits(values[i]);
    std::memcpy(m.owned.data() + 2 * i, &b, 2);
  }
  m.data = m.owned;
  return m;
}

// An F32 copy of m, [rows, cols], element (r, c) of m at (row_at(r), col_at(c)), zeros elsewhere.
WeightMatrix padded(const WeightMatrix& m, int64_t rows, int64_t cols, const std::function<int64_t(int64_t)>& row_at,
                    const std::function<int64_t(int64_t)>& col_at) {
  std::vector<float> v(size_t(rows * cols), 0.0f);
  const std::vector<float> d = m.dequantize();
  for (int64_t r = 0; r < m.rows; ++r)
    for (int64_t c = 0; c < m.cols; ++c) v[size_t(row_at(r) * cols + col_at(c))] = d[size_t(r * m.cols + c)];
  WeightMatrix p;
  p.name = m.name;
  p.rows = rows, p.cols = cols;
  p.dtype = DType::kF32;
  p.owned.assign(reinterpret_cast<const uint8_t*>(v.data()), reinterpret_cast<const uint8_t*>(v.data() + v.size()));
  p.data = p.owned;
  return p;
}

TEST(OddDims, LinearMatchesAFloat64Product) {
  // Input widths 320 and 160 (2.5 and 1.25 blocks), outputs of any width,
  // FP8 weights with partial scale blocks and bf16 weights, cached or not.
  const int T = 5;
  for (auto [out, in] : {std::pair<int64_t, int64_t>{160, 320}, {512, 160}, {200, 160}, {80, 320}}) {
    const std::vector<float> values = randn(size_t(out * in), uint32_t(out * 1000 + in), 0.05f);
    const std::vector<float> x = randn(size_t(T * in), 7);
    for (bool fp8 : {true, false}) {
      const WeightMatrix m = fp8 ? quantize_fp8_matrix("w", values, out, in) : bf16_matrix(values, out, in);
      if (fp8) {
        ASSERT_EQ(m.block_scales.size(), size_t(((out + 127) / 128) * ((in + 127) / 128)));
      }
      for (bool cached : {true, false}) {
        const Linear lin(&m, LinearMode::kFp8, cached);
        std::vector<float> y(size_t(T * out), NAN);
        lin.forward(x.data(), T, y.data(), Profile::kExact);
        for (int t = 0; t < T; ++t)
          for (int64_t o = 0; o < out; ++o) {
            double ref = 0, mag = 0;
            for (int64_t i = 0; i < in; ++i) {
              ref += double(x[size_t(t * in + i)]) * m.at(o, i);
              mag += std::fabs(double(x[size_t(t * in + i)]) * m.at(o, i));
            }
            // float32 accumulation of `in` products: a few ulps of the magnitude.
            ASSERT_NEAR(y[size_t(t * out + o)], ref, 1e-6 * mag + 1e-12)
                << out << "x" << in << (fp8 ? " fp8" : " bf16") << (cached ? " cached" : "") << " at (" << t << ", "
                << o << ")";
          }
      }
    }
  }
}

TEST(OddDims, GroupedRowsOfAnOddWidth) {
  // wo_a's shape: 2 groups of 80 rows, each run on its column block of the input.
  const int T = 3, G = 2, r = 80, in = 1024;
  const WeightMatrix m = bf16_matrix(randn(size_t(G * r * in), 11, 0.03f), G * r, in);
  const std::vector<float> x = randn(size_t(T * G * in), 12);
  std::vector<float> u(size_t(T * G * r), NAN);
  for (int g = 0; g < G; ++g) {
    const Linear lin(&m, LinearMode::kBf16, true, int64_t(g) * r, r);
    lin.forward(x.data() + size_t(g) * in, G * in, T, u.data() + size_t(g) * r, G * r, Profile::kExact);
  }
  for (int t = 0; t < T; ++t)
    for (int g = 0; g < G; ++g)
      for (int j = 0; j < r; ++j) {
        double ref = 0, mag = 0;
        for (int i = 0; i < in; ++i) {
          const double p = double(x[size_t(t * G * in + g * in + i)]) * m.at(g * r + j, i);
          ref += p, mag += std::fabs(p);
        }
        ASSERT_NEAR(u[size_t(t * G * r + g * r + j)], ref, 1e-6 * mag) << "token " << t << " group " << g << " row " << j;
      }
}

TEST(OddDims, SyntheticWeightsHavePartialBlocks) {
  const ModelConfig c = odd_config();
  for (int layer = 0; layer < c.num_layers; ++layer) {
    const LayerWeights q = random_layer_weights(c, layer, 5, true), b = random_layer_weights(c, layer, 5, false);
    EXPECT_TRUE(find_nonfinite(q).empty()) << layer;
    EXPECT_TRUE(find_nonfinite(b).empty()) << layer;
    for (auto [mq, mb] : {std::pair{&q.wq_a, &b.wq_a}, {&q.wq_b, &b.wq_b}, {&q.wkv, &b.wkv}, {&q.wo_a, &b.wo_a},
                          {&q.wo_b, &b.wo_b}}) {
      ASSERT_EQ(mq->dtype, DType::kF8E4M3) << mq->name;
      ASSERT_EQ(mq->block_scales.size(), size_t(((mq->rows + 127) / 128) * ((mq->cols + 127) / 128))) << mq->name;
      // Every element, in partial blocks too, is the fp8 rounding of the bf16 variant's value.
      const std::vector<float> dq = mq->dequantize(), db = mb->dequantize();
      for (size_t i = 0; i < dq.size(); ++i) {
        const int64_t r = int64_t(i) / mq->cols, col = int64_t(i) % mq->cols;
        const float scale = mq->block_scales[size_t((r / 128) * mq->scale_cols() + col / 128)];
        ASSERT_LE(std::fabs(dq[i] - db[i]), std::fabs(db[i]) * (1.0f / 16 + 1.0f / 128) + scale / 1024)
            << mq->name << " at (" << r << ", " << col << ")";
      }
    }
    EXPECT_EQ(q.wq_a.cols, 320);
    EXPECT_EQ(q.wo_b.cols, 160);
    EXPECT_EQ(q.q_norm.size(), 160u);
  }
}

// Model B's weights: model A's (bf16) in F32 matrices, zero-padded from hidden
// 320 to 384 and from o_lora_rank 80 to 128 per group.
LayerWeights pad_layer(const LayerWeights& a, const ModelConfig& ca, const ModelConfig& cb) {
  const int64_t D = cb.hidden_size, G = ca.o_groups, oa = ca.o_lora_rank, ob = cb.o_lora_rank;
  auto same = [](int64_t i) { return i; };
  auto group = [=](int64_t i) { return i / oa * ob + i % oa; };  // row/col of group g's j-th rank
  auto cols_to_d = [&](const WeightMatrix& m) { return padded(m, m.rows, D, same, same); };
  LayerWeights b = a;
  b.wq_a = cols_to_d(a.wq_a);
  b.wq_b = padded(a.wq_b, a.wq_b.rows, a.wq_b.cols, same, same);
  b.wkv = cols_to_d(a.wkv);
  b.wo_a = padded(a.wo_a, G * ob, a.wo_a.cols, group, same);
  b.wo_b = padded(a.wo_b, D, G * ob, same, group);
  if (b.compressor) {
    b.compressor->wkv = cols_to_d(a.compressor->wkv);
    b.compressor->wgate = cols_to_d(a.compressor->wgate);
  }
  if (b.indexer) {
    b.indexer->wq_b = padded(a.indexer->wq_b, a.indexer->wq_b.rows, a.indexer->wq_b.cols, same, same);
    b.indexer->weights_proj = cols_to_d(a.indexer->weights_proj);
    b.indexer->compressor.wkv = cols_to_d(a.indexer->compressor.wkv);
    b.indexer->compressor.wgate = cols_to_d(a.indexer->compressor.wgate);
  }
  return b;
}

TEST(OddDims, LayersEqualTheZeroPaddedModel) {
  const ModelConfig ca = odd_config(), cb = odd_config(384, 128);
  std::vector<LayerWeights> wa, wb;
  for (int l = 0; l < ca.num_layers; ++l) {
    wa.push_back(random_layer_weights(ca, l, 21, false));
    wb.push_back(pad_layer(wa.back(), ca, cb));
  }
  EngineOptions eo;
  eo.profile = Profile::kExact;
  eo.workload = CacheWorkload{2, 512, 512};
  Engine a(ca, wa, eo), b(cb, wb, eo);
  for (int64_t r : {0, 1}) a.open_request(r), b.open_request(r);
  // Prefill in one run and in chunks, then decode; at most 202 positions, so
  // the C4A indexer keeps every entry (64 >= 202 / 4) and no near-tie of its
  // scores can pick differently in the two models.
  const std::vector<std::vector<dsv4::Run>> steps = {
      {{0, 0, 200}, {1, 0, 37}}, {{0, 200, 1}, {1, 37, 60}}, {{0, 201, 1}, {1, 97, 1}}};
  for (size_t step = 0; step < steps.size(); ++step) {
    std::vector<RunError> ea, eb;
    const StepMetadata sa = a.plan(steps[step], ea), sb = b.plan(steps[step], eb);
    ASSERT_TRUE(ea.empty() && eb.empty()) << (ea.empty() ? eb[0].message : ea[0].message);
    const int T = sa.num_tokens();
    const std::vector<float> xa = randn(size_t(T) * 320, uint32_t(100 + step));
    std::vector<float> xb(size_t(T) * 384, 0.0f);
    for (int t = 0; t < T; ++t) std::copy_n(xa.begin() + t * 320, 320, xb.begin() + t * 384);
    std::vector<std::vector<float>> outs_b;
    b.forward_layers(sb, xb, false, [&](int, std::span<const float> y, const LayerCapture*) {
      outs_b.emplace_back(y.begin(), y.end());
    });
    a.forward_layers(sa, xa, false, [&](int l, std::span<const float> ya, const LayerCapture*) {
      const std::vector<float>& yb = outs_b[size_t(l)];
      for (int t = 0; t < T; ++t) {
        double num = 0, den = 0;
        for (int d = 0; d < 320; ++d) {
          const double ours = ya[size_t(t * 320 + d)], padded_model = yb[size_t(t * 384 + d)];
          ASSERT_TRUE(std::isfinite(ours)) << "step " << step << " layer " << l << " token " << t << " dim " << d;
          num += (ours - padded_model) * (ours - padded_model), den += padded_model * padded_model;
        }
        // Float32 sums in another blocking: ~1e-7 relative; the exact-profile golden bar is 1e-4.
        ASSERT_LE(std::sqrt(num / den), 1e-5) << "step " << step << " layer " << l << " token " << t;
        for (int d = 320; d < 384; ++d)
          ASSERT_EQ(yb[size_t(t * 384 + d)], 0.0f) << "padding row of wo_b, token " << t << " dim " << d;
      }
    });
    a.commit(sa), b.commit(sb);
  }
}

TEST(OddDims, ProductionProfileStatesItsRequirement) {
  const std::string e = test::error_of([] { check_production_dims(odd_config()); });
  EXPECT_NE(e.find("hidden_size = 320 is not a multiple of 128"), std::string::npos) << e;
  EXPECT_NE(e.find("production profile"), std::string::npos) << e;
}

}  // namespace
}  // namespace dsv4
