// Attention-layer weights (SPEC §3): the tensor specs against both golden
// weight files, loading and its errors, FP8 block quantization, and the
// synthetic weight generator.
#include "model/weights.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <functional>
#include <map>
#include <set>

#include "common/error.h"
#include "common/huge_pages.h"
#include "numerics/bf16.h"
#include "numerics/e4m3.h"
#include "numerics/ue8m0.h"
#include "support/edited_safetensors.h"
#include "support/error_of.h"
#include "support/temp_dir.h"

namespace dsv4 {
namespace {

namespace fs = std::filesystem;

const fs::path kMini = fs::path(DSV4_GOLDEN_DIR) / "mini.weights.safetensors";
const fs::path kMiniFp8 = fs::path(DSV4_GOLDEN_DIR) / "mini-fp8.weights.safetensors";

using dsv4::test::find_tensor;
using dsv4::test::OwnedTensor;
using dsv4::test::rewrite_safetensors;
using dsv4::test::TempDir;
using dsv4::test::TensorListEdit;

using dsv4::test::error_of;



// Writes a copy of `golden` after `edit` changed its tensor list; returns the path.
fs::path edited_copy(const TempDir& dir, const fs::path& golden, const TensorListEdit& edit) {
  const fs::path p = dir / ("edited-" + golden.filename().string());
  rewrite_safetensors(golden, p, edit);
  return p;
}

void remove_tensor(std::vector<OwnedTensor>& ts, const std::string& name) {
  std::erase_if(ts, [&](const OwnedTensor& t) { return t.name == name; });
}

std::string load_error(const fs::path& p, int layer) {
  const Checkpoint c = Checkpoint::open(p);
  return error_of([&] { load_layer_weights(c, preset_config("mini"), layer); });
}

bool is_fp8_matrix_name(const std::string& n) {
  for (const char* s : {"wq_a.weight", "wq_b.weight", "wkv.weight", "wo_a.weight", "wo_b.weight"})
    if (n.ends_with(std::string("attn.") + s)) return true;
  return n.ends_with("indexer.wq_b.weight");
}

// ---- specs ------------------------------------------------------------------------------

TEST(TensorSpecs, MatchBothGoldenFilesExactly) {
  const ModelConfig cfg = preset_config("mini");
  for (const fs::path& path : {kMini, kMiniFp8}) {
    const Checkpoint c = Checkpoint::open(path);
    std::set<std::string> expected;
    for (int layer = 0; layer < cfg.num_layers; ++layer)
      for (const TensorSpec& s : attention_tensor_specs(cfg, layer)) {
        expected.insert(s.name);
        const TensorView* t = c.find(s.name);
        ASSERT_NE(t, nullptr) << path << ": " << s.name;
        EXPECT_EQ(t->shape, s.shape) << s.name;
        EXPECT_EQ(s.kind == TensorKind::kFp8Matrix, is_fp8_matrix_name(s.name)) << s.name;
        if (t->dtype == DType::kF8E4M3) expected.insert(scale_name(s.name));
      }
    std::set<std::string> present;
    for (const TensorView* t : c.tensors()) present.insert(t->name);
    EXPECT_EQ(present, expected) << path;
  }
}

TEST(TensorSpecs, FlashShapes) {
  const ModelConfig cfg = preset_config("flash");
  auto shape_of = [&](int layer, const std::string& suffix) {
    for (const TensorSpec& s : attention_tensor_specs(cfg, layer))
      if (s.name == layer_prefix(layer) + suffix) return s.shape;
    return std::vector<int64_t>{-1};
  };
  using V = std::vector<int64_t>;
  EXPECT_EQ(attention_tensor_specs(cfg, 0).size(), 8u);   // SWA-only
  EXPECT_EQ(attention_tensor_specs(cfg, 2).size(), 18u);  // C4A
  EXPECT_EQ(attention_tensor_specs(cfg, 3).size(), 12u);  // C128A
  EXPECT_EQ(shape_of(0, "wq_a.weight"), (V{1024, 4096}));
  EXPECT_EQ(shape_of(0, "wq_b.weight"), (V{32768, 1024}));
  EXPECT_EQ(shape_of(0, "wkv.weight"), (V{512, 4096}));
  EXPECT_EQ(shape_of(0, "wo_a.weight"), (V{8192, 4096}));
  EXPECT_EQ(shape_of(0, "wo_b.weight"), (V{4096, 8192}));
  EXPECT_EQ(shape_of(0, "attn_sink"), (V{64}));
  EXPECT_EQ(shape_of(2, "compressor.wkv.weight"), (V{1024, 4096}));
  EXPECT_EQ(shape_of(2, "compressor.ape"), (V{4, 1024}));
  EXPECT_EQ(shape_of(2, "indexer.wq_b.weight"), (V{8192, 1024}));
  EXPECT_EQ(shape_of(2, "indexer.weights_proj.weight"), (V{64, 4096}));
  EXPECT_EQ(shape_of(2, "indexer.compressor.wgate.weight"), (V{256, 4096}));
  EXPECT_EQ(shape_of(2, "indexer.compressor.ape"), (V{4, 256}));
  EXPECT_EQ(shape_of(2, "indexer.compressor.norm.weight"), (V{128}));
  EXPECT_EQ(shape_of(3, "compressor.wgate.weight"), (V{512, 4096}));
  EXPECT_EQ(shape_of(3, "compressor.ape"), (V{128, 512}));
  EXPECT_EQ(shape_of(3, "compressor.norm.weight"), (V{512}));
  EXPECT_MENTIONS(error_of([&] { attention_tensor_specs(cfg, 43); }), "layer 43 does not exist");
}

TEST(TensorSpecs, ScaleName) {
  EXPECT_EQ(scale_name("layers.0.attn.wq_a.weight"), "layers.0.attn.wq_a.scale");
  EXPECT_EQ(scale_name("x"), "x.scale");
}

// ---- loading the golden files ---------------------------------------------------------------

// Structure every loaded layer must have, whatever the storage dtype.
void expect_layer_shape(const LayerWeights& w, const ModelConfig& cfg, int layer) {
  EXPECT_EQ(w.layer, layer);
  EXPECT_EQ(w.type, cfg.layer_type(layer));
  EXPECT_EQ(w.q_norm.size(), size_t(cfg.q_lora_rank));
  EXPECT_EQ(w.kv_norm.size(), 512u);
  EXPECT_EQ(w.attn_sink.size(), size_t(cfg.num_heads));
  EXPECT_EQ(w.wq_b.rows, cfg.num_heads * 512);
  EXPECT_EQ(w.wo_a.cols, cfg.num_heads * 512 / cfg.o_groups);
  EXPECT_EQ(w.compressor.has_value(), w.type != LayerType::kSwaOnly);
  EXPECT_EQ(w.indexer.has_value(), w.type == LayerType::kC4A);
  if (w.compressor) {
    const int m = compress_ratio(w.type), k = m == 4 ? 2 : 1;
    EXPECT_EQ(w.compressor->ratio, m);
    EXPECT_EQ(w.compressor->coff, k);
    EXPECT_EQ(w.compressor->dim, 512);
    EXPECT_EQ(w.compressor->wkv.rows, k * 512);
    EXPECT_EQ(w.compressor->ape.size(), size_t(m * k * 512));
    EXPECT_EQ(w.compressor->norm.size(), 512u);
  }
  if (w.indexer) {
    EXPECT_EQ(w.indexer->compressor.ratio, 4);
    EXPECT_EQ(w.indexer->compressor.dim, 128);
    EXPECT_EQ(w.indexer->compressor.wgate.rows, 256);
    EXPECT_EQ(w.indexer->compressor.ape.size(), 4u * 256u);
    EXPECT_EQ(w.indexer->weights_proj.rows, cfg.index_n_heads);
  }
}

std::vector<const WeightMatrix*> fp8_matrices(const LayerWeights& w) {
  std::vector<const WeightMatrix*> m = {&w.wq_a, &w.wq_b, &w.wkv, &w.wo_a, &w.wo_b};
  if (w.indexer) m.push_back(&w.indexer->wq_b);
  return m;
}

std::vector<const WeightMatrix*> dense_matrices(const LayerWeights& w) {
  std::vector<const WeightMatrix*> m;
  for (const auto* c : {w.compressor ? &*w.compressor : nullptr, w.indexer ? &w.indexer->compressor : nullptr})
    if (c) {
      m.push_back(&c->wkv);
      m.push_back(&c->wgate);
    }
  if (w.indexer) m.push_back(&w.indexer->weights_proj);
  return m;
}

void expect_sane(const std::vector<float>& v, const std::string& what) {
  double sum_sq = 0;
  for (float x : v) {
    ASSERT_TRUE(std::isfinite(x)) << what;
    sum_sq += double(x) * x;
  }
  EXPECT_GT(sum_sq, 0) << what;
}

TEST(LoadLayerWeights, MiniBf16) {
  const ModelConfig cfg = preset_config("mini");
  const Checkpoint c = Checkpoint::open(kMini);
  for (int layer = 0; layer < cfg.num_layers; ++layer) {
    const LayerWeights w = load_layer_weights(c, cfg, layer);
    expect_layer_shape(w, cfg, layer);
    for (const WeightMatrix* m : fp8_matrices(w)) {
      EXPECT_EQ(m->dtype, DType::kBF16) << m->name;
      EXPECT_TRUE(m->block_scales.empty()) << m->name;
      // Zero copy: the matrix views the mapped file.
      EXPECT_EQ(m->data.data(), c.find(m->name)->bytes.data()) << m->name;
      expect_sane(m->dequantize(), m->name);
    }
    for (const WeightMatrix* m : dense_matrices(w)) EXPECT_EQ(m->dtype, DType::kBF16) << m->name;
    // fp32 attn_sink is copied verbatim.
    const TensorView* sink = c.find(layer_prefix(layer) + "attn_sink");
    for (size_t h = 0; h < w.attn_sink.size(); ++h) {
      float f;
      std::memcpy(&f, sink->bytes.data() + 4 * h, 4);
      EXPECT_EQ(w.attn_sink[h], f);
    }
    // bf16 norms decode bit-exactly.
    const TensorView* qn = c.find(layer_prefix(layer) + "q_norm.weight");
    for (size_t i = 0; i < w.q_norm.size(); ++i) {
      uint16_t b;
      std::memcpy(&b, qn->bytes.data() + 2 * i, 2);
      EXPECT_EQ(w.q_norm[i], bf16_to_float(b));
    }
  }
}

TEST(LoadLayerWeights, MiniFp8) {
  const ModelConfig cfg = preset_config("mini");
  const Checkpoint c = Checkpoint::open(kMiniFp8);
  for (int layer = 0; layer < cfg.num_layers; ++layer) {
    const LayerWeights w = load_layer_weights(c, cfg, layer);
    expect_layer_shape(w, cfg, layer);
    for (const WeightMatrix* m : fp8_matrices(w)) {
      ASSERT_EQ(m->dtype, DType::kF8E4M3) << m->name;
      const TensorView* scale = c.find(scale_name(m->name));
      ASSERT_EQ(m->block_scales.size(), size_t(scale->numel())) << m->name;
      for (size_t i = 0; i < m->block_scales.size(); ++i)
        EXPECT_EQ(m->block_scales[i], std::ldexp(1.0f, int(scale->bytes[i]) - 127)) << m->name;
      const std::vector<float> d = m->dequantize();
      expect_sane(d, m->name);
      // dequantize() and at() agree with an independent decode of the raw bytes.
      for (int64_t r = 0; r < m->rows; r += 37)
        for (int64_t col = 0; col < m->cols; col += 29) {
          const float expected = e4m3_to_float(m->data[size_t(r * m->cols + col)]) *
                                 m->block_scales[size_t((r / 128) * m->scale_cols() + col / 128)];
          EXPECT_EQ(m->at(r, col), expected);
          EXPECT_EQ(d[size_t(r * m->cols + col)], expected);
        }
    }
    for (const WeightMatrix* m : dense_matrices(w)) EXPECT_EQ(m->dtype, DType::kBF16) << m->name;
    if (w.compressor) expect_sane(w.compressor->ape, "ape");
  }
}

// dequantize_rows decodes through a table: every one of the 256 codes (NaNs
// too), a scale per 128 x 128 block with partial blocks on both edges, and a
// first row inside a block, against e4m3_to_float times the block's scale.
TEST(WeightMatrix, DequantizeRowsDecodesEveryCodeWithItsBlockScale) {
  WeightMatrix m;
  m.name = "m";
  m.rows = 300, m.cols = 333;
  m.dtype = DType::kF8E4M3;
  m.owned.resize(size_t(m.rows * m.cols));
  for (size_t i = 0; i < m.owned.size(); ++i) m.owned[i] = uint8_t(i * 7 % 256);
  m.data = m.owned;
  for (int64_t b = 0; b < 3 * m.scale_cols(); ++b) m.block_scales.push_back(std::ldexp(1.0f, int(b % 9) - 4));
  const int64_t r0 = 5, n = m.rows - r0;
  std::vector<float> out(size_t(n * m.cols));
  m.dequantize_rows(r0, n, out.data());
  for (int64_t r = r0; r < m.rows; ++r)
    for (int64_t c = 0; c < m.cols; ++c) {
      const float want = e4m3_to_float(m.owned[size_t(r * m.cols + c)]) *
                         m.block_scales[size_t((r / 128) * m.scale_cols() + c / 128)];
      const float got = out[size_t((r - r0) * m.cols + c)];
      ASSERT_TRUE(std::isnan(want) ? std::isnan(got) : got == want) << "row " << r << ", column " << c;
    }
}

// The weights' buffers are sized through resize_on_huge_pages (a hint to the
// kernel, then a plain resize): below and above the size it advises from,
// every element is there and zero, as after resize.
TEST(WeightMatrix, BuffersOnHugePagesAreZeroedLikeResize) {
  for (const size_t n : {size_t(1000), size_t(9) << 20}) {
    std::vector<uint8_t> v;
    resize_on_huge_pages(v, n);
    ASSERT_EQ(v.size(), n);
    EXPECT_EQ(std::count(v.begin(), v.end(), uint8_t(0)), std::ptrdiff_t(n));
  }
}

// ---- load errors on edited copies ------------------------------------------------------------

TEST(LoadErrors, WrongDtype) {
  TempDir dir;
  const std::string name = "layers.0.attn.wq_a.weight";
  const auto p = edited_copy(dir, kMini, [&](auto& ts) { find_tensor(ts, name).dtype = DType::kI16; });
  const std::string msg = load_error(p, 0);
  EXPECT_MENTIONS(msg, "tensor '" + name + "' has dtype I16; expected one of F8_E4M3, BF16, F32");
  const auto q = edited_copy(dir, kMini,
                             [&](auto& ts) { find_tensor(ts, "layers.2.attn.compressor.norm.weight").dtype = DType::kF16; });
  EXPECT_MENTIONS(load_error(q, 2), "'layers.2.attn.compressor.norm.weight' has dtype F16; expected one of BF16, F32");
}

TEST(LoadErrors, WrongShape) {
  TempDir dir;
  const std::string name = "layers.1.attn.wq_a.weight";
  const auto p = edited_copy(dir, kMini, [&](auto& ts) { find_tensor(ts, name).shape = {256, 128}; });
  EXPECT_MENTIONS(load_error(p, 1), "tensor '" + name + "' has shape [256, 128]; expected [128, 256]");
}

TEST(LoadErrors, MissingTensor) {
  TempDir dir;
  const std::string name = "layers.1.attn.indexer.weights_proj.weight";
  const auto p = edited_copy(dir, kMini, [&](auto& ts) { remove_tensor(ts, name); });
  EXPECT_MENTIONS(load_error(p, 1), "missing tensor '" + name + "'");
  EXPECT_NO_THROW(load_layer_weights(Checkpoint::open(p), preset_config("mini"), 2));
}

TEST(LoadErrors, MissingScale) {
  TempDir dir;
  const auto p = edited_copy(dir, kMiniFp8, [&](auto& ts) { remove_tensor(ts, "layers.0.attn.wq_b.scale"); });
  EXPECT_MENTIONS(load_error(p, 0),
                  "tensor 'layers.0.attn.wq_b.weight' is F8_E4M3 but its scale 'layers.0.attn.wq_b.scale' is missing");
}

TEST(LoadErrors, BadScales) {
  TempDir dir;
  const std::string name = "layers.2.attn.wo_a.scale";
  const auto shape = edited_copy(dir, kMiniFp8, [&](auto& ts) { find_tensor(ts, name).shape = {8, 1}; });
  EXPECT_MENTIONS(load_error(shape, 2), "tensor '" + name + "' has shape [8, 1]; expected [1, 8]");
  const auto nan = edited_copy(dir, kMiniFp8, [&](auto& ts) { find_tensor(ts, name).bytes[3] = 0xff; });
  EXPECT_MENTIONS(load_error(nan, 2), "tensor '" + name + "' holds nan at block 3");
  const auto dtype = edited_copy(dir, kMiniFp8, [&](auto& ts) { find_tensor(ts, name).dtype = DType::kU8; });
  EXPECT_MENTIONS(load_error(dtype, 2), "'" + name + "' has dtype U8; expected one of F8_E8M0, F32");
}

TEST(LoadErrors, ScaleBesideUnscaledWeight) {
  TempDir dir;
  const auto p = edited_copy(dir, kMini, [&](auto& ts) {
    ts.push_back({"layers.0.attn.wkv.scale", DType::kF8E8M0, {4, 2}, std::vector<uint8_t>(8, 127)});
  });
  EXPECT_MENTIONS(load_error(p, 0), "'layers.0.attn.wkv.scale' is present but 'layers.0.attn.wkv.weight' is BF16");
}

TEST(LoadErrors, F32ScalesAndF32WeightsAreAccepted) {
  TempDir dir;
  const std::string w = "layers.0.attn.wq_a.weight", s = "layers.0.attn.wq_a.scale";
  const auto p = edited_copy(dir, kMiniFp8, [&](auto& ts) {
    OwnedTensor& scale = find_tensor(ts, s);
    std::vector<uint8_t> f32;
    for (uint8_t b : scale.bytes) {
      const float v = ue8m0_to_float(b);
      f32.insert(f32.end(), reinterpret_cast<const uint8_t*>(&v), reinterpret_cast<const uint8_t*>(&v) + 4);
    }
    scale = {s, DType::kF32, scale.shape, f32};
  });
  const ModelConfig cfg = preset_config("mini");
  const auto original = load_layer_weights(Checkpoint::open(kMiniFp8), cfg, 0).wq_a.dequantize();
  const Checkpoint c = Checkpoint::open(p);
  EXPECT_EQ(load_layer_weights(c, cfg, 0).wq_a.dequantize(), original);

  // The same weight stored dequantized as F32, without a scale.
  const auto q = edited_copy(dir, kMiniFp8, [&](auto& ts) {
    remove_tensor(ts, s);
    std::vector<uint8_t> f32(original.size() * 4);
    std::memcpy(f32.data(), original.data(), f32.size());
    find_tensor(ts, w) = {w, DType::kF32, {128, 256}, f32};
  });
  const Checkpoint cq = Checkpoint::open(q);
  const LayerWeights lw = load_layer_weights(cq, cfg, 0);
  EXPECT_EQ(lw.wq_a.dtype, DType::kF32);
  EXPECT_EQ(lw.wq_a.dequantize(), original);
}

// ---- FP8 block quantization ------------------------------------------------------------------

// Every code equals the reference conversion of value / block scale, and each
// scale follows the SPEC §5 rule from its block's amax.
void expect_reference_quantization(const std::vector<float>& v, int64_t rows, int64_t cols) {
  const WeightMatrix m = quantize_fp8_matrix("q", v, rows, cols);
  ASSERT_EQ(m.dtype, DType::kF8E4M3);
  ASSERT_EQ(m.data.size(), v.size());
  ASSERT_EQ(m.block_scales.size(), size_t(((rows + 127) / 128) * m.scale_cols()));
  for (int64_t rb = 0; rb * 128 < rows; ++rb)
    for (int64_t cb = 0; cb < m.scale_cols(); ++cb) {
      float amax = 0;
      for (int64_t r = rb * 128; r < std::min(rows, rb * 128 + 128); ++r)
        for (int64_t c = cb * 128; c < std::min(cols, cb * 128 + 128); ++c)
          amax = std::max(amax, std::fabs(v[size_t(r * cols + c)]));
      const float scale = std::ldexp(1.0f, pow2_scale_exponent(amax, 1e-4f, 448.0f));
      ASSERT_EQ(m.block_scales[size_t(rb * m.scale_cols() + cb)], scale);
      for (int64_t r = rb * 128; r < std::min(rows, rb * 128 + 128); ++r)
        for (int64_t c = cb * 128; c < std::min(cols, cb * 128 + 128); ++c) {
          const float x = v[size_t(r * cols + c)];
          ASSERT_EQ(m.data[size_t(r * cols + c)], float_to_e4m3(x / scale)) << x << " / " << scale;
        }
    }
}

TEST(QuantizeFp8, MatchesReferenceOnRaggedBlocksAndWideRanges) {
  const int64_t rows = 200, cols = 300;
  std::vector<float> v(size_t(rows * cols));
  uint64_t s = 12345;
  for (auto& x : v) {
    s = s * 6364136223846793005ull + 1442695040888963407ull;
    const int e = int((s >> 33) % 40) - 30;
    x = std::ldexp(float((s >> 40) & 0xffff) / 65536.0f - 0.5f, e);
  }
  for (int64_t c = 0; c < 128; ++c) v[size_t(c)] = 0;  // an all-zero block row start
  expect_reference_quantization(v, rows, cols);
}

TEST(QuantizeFp8, FastConversionMatchesReferenceAcrossTheRange) {
  // Blocks whose amax is 448 have scale 1, so codes are plain conversions of
  // the values: sweep float bit patterns below 448, both signs, plus every
  // midpoint between neighbouring e4m3 values (the ties) and its neighbours.
  std::vector<float> v;
  for (uint32_t u = 0; u < std::bit_cast<uint32_t>(448.0f); u += 509) {
    v.push_back(std::bit_cast<float>(u));
    v.push_back(-std::bit_cast<float>(u));
  }
  for (int code = 0; code < 0x7e; ++code) {
    const float mid = (e4m3_to_float(uint8_t(code)) + e4m3_to_float(uint8_t(code + 1))) / 2;
    for (float x : {mid, std::nextafter(mid, 0.0f), std::nextafter(mid, 1000.0f)}) v.insert(v.end(), {x, -x});
  }
  const int64_t cols = 128;
  std::vector<float> padded;
  for (size_t i = 0; i < v.size(); ++i) {
    if (padded.size() % (128 * cols) == 0) padded.push_back(448.0f);  // pins each block's amax
    padded.push_back(v[i]);
  }
  padded.resize((padded.size() + 128 * cols - 1) / (128 * cols) * (128 * cols), 0.0f);
  const int64_t rows = int64_t(padded.size()) / cols;
  const WeightMatrix m = quantize_fp8_matrix("sweep", padded, rows, cols);
  for (float s : m.block_scales) ASSERT_EQ(s, 1.0f);
  for (size_t i = 0; i < padded.size(); ++i) ASSERT_EQ(m.data[i], float_to_e4m3(padded[i])) << padded[i];
}

TEST(QuantizeFp8, RejectsBadInput) {
  std::vector<float> v(4, 1.0f);
  EXPECT_MENTIONS(error_of([&] { quantize_fp8_matrix("m", v, 3, 2); }), "m: 4 values for a [3, 2] matrix");
  v[2] = INFINITY;
  EXPECT_MENTIONS(error_of([&] { quantize_fp8_matrix("m", v, 2, 2); }), "non-finite");
}

// ---- synthetic weights --------------------------------------------------------------------------

std::vector<const WeightMatrix*> all_matrices(const LayerWeights& w) {
  auto m = fp8_matrices(w);
  const auto d = dense_matrices(w);
  m.insert(m.end(), d.begin(), d.end());
  return m;
}

std::vector<const std::vector<float>*> all_vectors(const LayerWeights& w) {
  std::vector<const std::vector<float>*> v = {&w.q_norm, &w.kv_norm, &w.attn_sink};
  for (const auto* c : {w.compressor ? &*w.compressor : nullptr, w.indexer ? &w.indexer->compressor : nullptr})
    if (c) {
      v.push_back(&c->ape);
      v.push_back(&c->norm);
    }
  return v;
}

bool same(const LayerWeights& a, const LayerWeights& b) {
  const auto ma = all_matrices(a), mb = all_matrices(b);
  const auto va = all_vectors(a), vb = all_vectors(b);
  if (ma.size() != mb.size() || va.size() != vb.size()) return false;
  for (size_t i = 0; i < ma.size(); ++i)
    if (!std::equal(ma[i]->data.begin(), ma[i]->data.end(), mb[i]->data.begin(), mb[i]->data.end()) ||
        ma[i]->block_scales != mb[i]->block_scales)
      return false;
  for (size_t i = 0; i < va.size(); ++i)
    if (*va[i] != *vb[i]) return false;
  return true;
}

TEST(RandomWeights, DeterministicPerSeedAndLayer) {
  const ModelConfig cfg = preset_config("mini");
  for (bool fp8 : {false, true}) {
    const LayerWeights a = random_layer_weights(cfg, 1, 7, fp8);
    EXPECT_TRUE(same(a, random_layer_weights(cfg, 1, 7, fp8)));
    EXPECT_FALSE(same(a, random_layer_weights(cfg, 1, 8, fp8)));
    // Same layer type, other layer index: other weights.
    ModelConfig two = cfg;
    two.compress_ratios = {4, 4, 4};
    EXPECT_FALSE(same(random_layer_weights(two, 0, 7, fp8), random_layer_weights(two, 1, 7, fp8)));
  }
}

TEST(RandomWeights, DtypesShapesAndScale) {
  const ModelConfig cfg = preset_config("mini");
  for (int layer = 0; layer < cfg.num_layers; ++layer) {
    const LayerWeights w = random_layer_weights(cfg, layer, 42, true);
    expect_layer_shape(w, cfg, layer);
    for (const TensorSpec& s : attention_tensor_specs(cfg, layer)) {
      if (s.shape.size() != 2 || s.kind == TensorKind::kF32) continue;
      const WeightMatrix* m = nullptr;
      for (const WeightMatrix* x : all_matrices(w))
        if (x->name == s.name) m = x;
      ASSERT_NE(m, nullptr) << s.name;
      EXPECT_EQ((std::vector<int64_t>{m->rows, m->cols}), s.shape) << s.name;
      EXPECT_EQ(m->dtype, s.kind == TensorKind::kFp8Matrix ? DType::kF8E4M3 : DType::kBF16) << s.name;
      for (float sc : m->block_scales) EXPECT_EQ(sc, std::ldexp(1.0f, ceil_log2(sc))) << s.name;
      // Entries ~ N(0, 1/in): check the sample standard deviation.
      const auto d = m->dequantize();
      double sum = 0, sum_sq = 0;
      for (float x : d) sum += x, sum_sq += double(x) * x;
      const double mean = sum / double(d.size()), sd = std::sqrt(sum_sq / double(d.size()) - mean * mean);
      EXPECT_NEAR(sd * std::sqrt(double(m->cols)), 1.0, 0.1) << s.name;
      EXPECT_NEAR(mean * std::sqrt(double(m->cols)), 0.0, 0.1) << s.name;
    }
    for (float x : w.q_norm) EXPECT_NEAR(x, 1.0f, 0.5f);
    for (float x : w.q_norm) EXPECT_EQ(x, round_bf16(x)) << "norms are bf16 values";
    expect_sane(w.attn_sink, "attn_sink");
    if (w.compressor) expect_sane(w.compressor->ape, "ape");
  }
}

// What the CPU backend reports as its weights: every tensor SPEC §3 lists,
// counted here from the specs' shapes (FP8 matrices at one byte plus a float
// per 128x128 block; bf16 matrices at two bytes; vectors held as floats).
TEST(RandomWeights, StoredBytesCountEveryTensor) {
  const ModelConfig cfg = preset_config("mini");
  for (bool fp8 : {false, true})
    for (int layer = 0; layer < cfg.num_layers; ++layer) {
      int64_t expect = 0;
      for (const TensorSpec& s : attention_tensor_specs(cfg, layer)) {
        int64_t n = 1;
        for (int64_t d : s.shape) n *= d;
        if (s.kind == TensorKind::kFp8Matrix && fp8)
          expect += n + 4 * ((s.shape[0] + 127) / 128) * ((s.shape[1] + 127) / 128);
        else if (s.kind == TensorKind::kFp8Matrix || s.kind == TensorKind::kDenseMatrix) expect += 2 * n;
        else expect += 4 * n;
      }
      EXPECT_EQ(stored_bytes(random_layer_weights(cfg, layer, 5, fp8)), expect) << "layer " << layer << " fp8 " << fp8;
    }
}

TEST(RandomWeights, Fp8RoundsTheSameValuesAsBf16) {
  const ModelConfig cfg = preset_config("mini");
  const LayerWeights q = random_layer_weights(cfg, 1, 3, true), b = random_layer_weights(cfg, 1, 3, false);
  EXPECT_TRUE(all_vectors(q).size() == all_vectors(b).size());
  for (size_t i = 0; i < all_vectors(q).size(); ++i) EXPECT_EQ(*all_vectors(q)[i], *all_vectors(b)[i]);
  const auto mq = fp8_matrices(q), mb = fp8_matrices(b);
  for (size_t i = 0; i < mq.size(); ++i) {
    ASSERT_EQ(mq[i]->dtype, DType::kF8E4M3);
    ASSERT_EQ(mb[i]->dtype, DType::kBF16);
    const auto dq = mq[i]->dequantize(), db = mb[i]->dequantize();
    double err = 0, norm = 0;
    for (size_t j = 0; j < dq.size(); ++j) {
      // e4m3 keeps 3 mantissa bits (relative error <= 2^-4), bf16 8; below
      // 2^-6 x scale e4m3 is subnormal with absolute error <= 2^-10 x scale.
      const int64_t r = int64_t(j) / mq[i]->cols, c = int64_t(j) % mq[i]->cols;
      const float scale = mq[i]->block_scales[size_t((r / 128) * mq[i]->scale_cols() + c / 128)];
      ASSERT_LE(std::fabs(dq[j] - db[j]), std::fabs(db[j]) * (1.0f / 16 + 1.0f / 128) + scale / 1024)
          << mq[i]->name << " at " << j;
      err += double(dq[j] - db[j]) * (dq[j] - db[j]);
      norm += double(db[j]) * db[j];
    }
    EXPECT_GT(err, 0) << "fp8 differs from bf16";
    EXPECT_LT(std::sqrt(err / norm), 0.05) << mq[i]->name;
  }
}

TEST(RandomWeights, CopiesOwnTheirData) {
  const ModelConfig cfg = preset_config("mini");
  LayerWeights copy;
  std::vector<float> expected;
  {
    const LayerWeights w = random_layer_weights(cfg, 0, 5, true);
    expected = w.wq_b.dequantize();
    copy = w;
    EXPECT_NE(copy.wq_b.data.data(), w.wq_b.data.data());
  }
  EXPECT_EQ(copy.wq_b.data.data(), copy.wq_b.owned.data());
  EXPECT_EQ(copy.wq_b.dequantize(), expected);
}

TEST(RandomWeights, FlashLayerIsQuickToGenerate) {
  const ModelConfig cfg = preset_config("flash");
  const auto t0 = std::chrono::steady_clock::now();
  const LayerWeights w = random_layer_weights(cfg, 2, 1, true);  // C4A: the largest layer
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  expect_layer_shape(w, cfg, 2);
  EXPECT_EQ(w.wo_a.dtype, DType::kF8E4M3);
  std::printf("flash C4A layer, fp8: %.3f s\n", seconds);
#ifdef NDEBUG
  EXPECT_LT(seconds, 3.0) << "dsv4 run builds whole stacks from these";
#endif
}

// ---- non-finite values ------------------------------------------------------------------------

TEST(NonFinite, SyntheticAndGoldenWeightsAreFinite) {
  const ModelConfig cfg = preset_config("mini");
  for (int layer = 0; layer < cfg.num_layers; ++layer) {
    for (bool fp8 : {false, true}) {
      const auto bad = find_nonfinite(random_layer_weights(cfg, layer, 9, fp8));
      EXPECT_TRUE(bad.empty()) << "layer " << layer << ": " << (bad.empty() ? "" : bad[0].name);
    }
    for (const fs::path& p : {kMini, kMiniFp8}) {
      const Checkpoint c = Checkpoint::open(p);
      EXPECT_TRUE(find_nonfinite(load_layer_weights(c, cfg, layer)).empty()) << p << " layer " << layer;
    }
  }
}

TEST(NonFinite, EveryStorageFormIsScanned) {
  const ModelConfig cfg = preset_config("mini");
  LayerWeights w = random_layer_weights(cfg, 1, 9, true);  // C4A: compressor and indexer too
  ASSERT_EQ(w.wq_b.dtype, DType::kF8E4M3);
  ASSERT_EQ(w.indexer->weights_proj.dtype, DType::kBF16);
  w.wq_b.owned[1234] = 0xff;  // e4m3fn NaN, negative
  w.wq_b.owned[5000] = 0x7f;  // e4m3fn NaN
  // bf16 +Inf (0x7f80) and a NaN (0xffc1) in weights_proj, little-endian.
  w.indexer->weights_proj.owned[2 * 7] = 0x80, w.indexer->weights_proj.owned[2 * 7 + 1] = 0x7f;
  w.indexer->weights_proj.owned[2 * 9] = 0xc1, w.indexer->weights_proj.owned[2 * 9 + 1] = 0xff;
  w.q_norm[3] = std::nanf("");
  w.compressor->ape[11] = -INFINITY;
  // A finite extreme value next to them is not reported: e4m3 448 (0x7e), bf16 max (0x7f7f).
  w.wq_a.owned[0] = 0x7e;
  w.indexer->wq_b.owned[1] = 0x7e;
  w.indexer->compressor.wkv.owned[0] = 0x7f, w.indexer->compressor.wkv.owned[1] = 0x7f;
  // An F32 matrix: a NaN with the exponent's low bit in byte 2.
  std::vector<float> values(size_t(w.wo_b.rows * w.wo_b.cols), 0.5f);
  values[77] = std::nanf("");
  w.wo_b.dtype = DType::kF32;
  w.wo_b.owned.assign(reinterpret_cast<const uint8_t*>(values.data()),
                      reinterpret_cast<const uint8_t*>(values.data() + values.size()));
  w.wo_b.data = w.wo_b.owned;
  w.wo_b.block_scales.clear();

  const auto bad = find_nonfinite(w);
  std::map<std::string, NonFiniteTensor> by_name;
  for (const auto& t : bad) by_name[t.name] = t;
  ASSERT_EQ(bad.size(), 5u) << "found " << bad.size();
  const std::string p = layer_prefix(1);
  auto expect = [&](const std::string& name, int64_t count, int64_t first, int64_t numel) {
    ASSERT_TRUE(by_name.count(p + name)) << name;
    const NonFiniteTensor& t = by_name[p + name];
    EXPECT_EQ(t.count, count) << name;
    EXPECT_EQ(t.first_index, first) << name;
    EXPECT_EQ(t.numel, numel) << name;
    EXPECT_FALSE(std::isfinite(t.first_value)) << name << ": " << t.first_value;
  };
  expect("wq_b.weight", 2, 1234, w.wq_b.rows * w.wq_b.cols);
  expect("indexer.weights_proj.weight", 2, 7, w.indexer->weights_proj.rows * w.indexer->weights_proj.cols);
  EXPECT_EQ(by_name[p + "indexer.weights_proj.weight"].first_value, INFINITY);
  expect("q_norm.weight", 1, 3, cfg.q_lora_rank);
  expect("compressor.ape", 1, 11, int64_t(w.compressor->ape.size()));
  EXPECT_EQ(by_name[p + "compressor.ape"].first_value, -INFINITY);
  expect("wo_b.weight", 1, 77, w.wo_b.rows * w.wo_b.cols);
  // SPEC §3 order: wq_b before wo_b before the compressor and the indexer.
  EXPECT_EQ(bad.front().name, p + "q_norm.weight");
  EXPECT_EQ(bad.back().name, p + "indexer.weights_proj.weight");
}

}  // namespace
}  // namespace dsv4
