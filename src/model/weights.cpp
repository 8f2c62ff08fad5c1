#include "model/weights.h"

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <map>
#include <numbers>

#include "common/error.h"
#include "common/hash.h"
#include "common/huge_pages.h"
#include "numerics/bf16.h"
#include "numerics/e4m3.h"
#include "numerics/quant.h"

namespace dsv4 {
namespace {

constexpr int64_t kBlock = 128;  // FP8 weight block: 128 x 128

int64_t numel(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

// ---- specs -----------------------------------------------------------------

// A compressor of ratio m over c-dim entries: k = 2 overlapping blocks when m == 4.
void add_compressor(std::vector<TensorSpec>& s, const std::string& p, int64_t m, int64_t c, int64_t hidden) {
  const int64_t k = m == 4 ? 2 : 1;
  s.push_back({p + "wkv.weight", {k * c, hidden}, TensorKind::kDenseMatrix});
  s.push_back({p + "wgate.weight", {k * c, hidden}, TensorKind::kDenseMatrix});
  s.push_back({p + "ape", {m, k * c}, TensorKind::kF32});
  s.push_back({p + "norm.weight", {c}, TensorKind::kVector});
}

// ---- reading tensors -----------------------------------------------------------

std::vector<DType> allowed_dtypes(TensorKind kind) {
  switch (kind) {
    case TensorKind::kFp8Matrix:
      return {DType::kF8E4M3, DType::kBF16, DType::kF32};
    case TensorKind::kDenseMatrix:
    case TensorKind::kVector:
      return {DType::kBF16, DType::kF32};
    case TensorKind::kF32:
      return {DType::kF32, DType::kBF16};
  }
  return {};
}

std::string dtype_list(const std::vector<DType>& types) {
  std::string s;
  for (DType t : types) s += (s.empty() ? "" : ", ") + std::string(dtype_name(t));
  return s;
}

// Finds a tensor and checks its dtype and shape against what is expected.
const TensorView& checked(const Checkpoint& ckpt, const std::string& name, const std::vector<int64_t>& shape,
                          const std::vector<DType>& dtypes) {
  const TensorView* t = ckpt.find(name);
  DSV4_REQUIRE(t != nullptr, ckpt.path().string() + ": missing tensor '" + name + "'");
  const std::string where = t->file + ": tensor '" + name + "'";
  DSV4_REQUIRE(std::find(dtypes.begin(), dtypes.end(), t->dtype) != dtypes.end(),
          where + " has dtype " + std::string(dtype_name(t->dtype)) + "; expected one of " + dtype_list(dtypes));
  DSV4_REQUIRE(t->shape == shape, where + " has shape " + shape_string(t->shape) + "; expected " + shape_string(shape));
  return *t;
}

// The block scales of an FP8 weight, as floats; each must be a finite positive power scale.
std::vector<float> load_scales(const Checkpoint& ckpt, const TensorView& weight, int64_t rows, int64_t cols) {
  const std::string sname = scale_name(weight.name);
  DSV4_REQUIRE(ckpt.find(sname) != nullptr,
          weight.file + ": tensor '" + weight.name + "' is F8_E4M3 but its scale '" + sname + "' is missing");
  const std::vector<int64_t> shape = {(rows + kBlock - 1) / kBlock, (cols + kBlock - 1) / kBlock};
  const TensorView& s = checked(ckpt, sname, shape, {DType::kF8E8M0, DType::kF32});
  std::vector<float> scales = s.floats();
  for (size_t i = 0; i < scales.size(); ++i)
    DSV4_REQUIRE(std::isfinite(scales[i]) && scales[i] > 0, s.file + ": tensor '" + sname + "' holds " +
                                                           std::to_string(scales[i]) + " at block " +
                                                           std::to_string(i) + "; scales must be finite and positive");
  return scales;
}

// Where the LayerWeights fields come from: a checkpoint or a random generator.
class TensorSource {
 public:
  virtual ~TensorSource() = default;
  virtual WeightMatrix matrix(const TensorSpec& spec) = 0;
  virtual std::vector<float> floats(const TensorSpec& spec) = 0;
};

class CheckpointSource : public TensorSource {
 public:
  explicit CheckpointSource(const Checkpoint& ckpt) : ckpt_(ckpt) {}

  WeightMatrix matrix(const TensorSpec& spec) override {
    const TensorView& t = checked(ckpt_, spec.name, spec.shape, allowed_dtypes(spec.kind));
    WeightMatrix m;
    m.name = spec.name;
    m.rows = spec.shape[0], m.cols = spec.shape[1];
    m.dtype = t.dtype;
    m.data = t.bytes;
    if (m.is_fp8()) {
      m.block_scales = load_scales(ckpt_, t, m.rows, m.cols);
    } else {
      // A scale next to an unscaled weight means the file is not what we think it is.
      DSV4_REQUIRE(ckpt_.find(scale_name(spec.name)) == nullptr,
              t.file + ": tensor '" + scale_name(spec.name) + "' is present but '" + spec.name + "' is " +
                  std::string(dtype_name(t.dtype)) + "; only F8_E4M3 weights take block scales");
    }
    return m;
  }

  std::vector<float> floats(const TensorSpec& spec) override {
    return checked(ckpt_, spec.name, spec.shape, allowed_dtypes(spec.kind)).floats();
  }

 private:
  const Checkpoint& ckpt_;
};

// ---- synthetic weights ---------------------------------------------------------

constexpr uint64_t kGolden = kGoldenGamma;

uint64_t name_hash(const std::string& name) {
  uint64_t h = 0xcbf29ce484222325ull;  // FNV-1a
  for (unsigned char ch : name) h = (h ^ ch) * 0x100000001b3ull;
  return h;
}

// Standard normal quantiles at (k + 1/2) / 4096, rescaled to unit variance:
// a 12-bit index picks a normal draw, so one 64-bit hash yields five of them
// (a synthetic Flash layer draws ~1.3e8 values).
constexpr int kNormalBits = 12;
constexpr int kDrawsPerHash = 64 / kNormalBits;

const std::vector<float>& normal_table() {
  static const std::vector<float> table = [] {
    const int n = 1 << kNormalBits;
    std::vector<double> q(static_cast<size_t>(n));
    for (int k = 0; k < n / 2; ++k) {
      // Newton on Phi(x) = p < 1/2 from 0: Phi is convex there, so the
      // iterates fall monotonically onto the root.
      const double p = (k + 0.5) / n;
      double x = 0;
      for (int it = 0; it < 100; ++it) {
        const double cdf = 0.5 * std::erfc(-x / std::numbers::sqrt2);
        const double pdf = std::exp(-x * x / 2) / std::sqrt(2 * std::numbers::pi);
        const double step = (cdf - p) / pdf;
        x -= step;
        if (std::fabs(step) < 1e-12) break;
      }
      q[size_t(k)] = x, q[size_t(n - 1 - k)] = -x;  // exactly symmetric: mean 0
    }
    double sum_sq = 0;
    for (double v : q) sum_sq += v * v;
    const double norm = std::sqrt(n / sum_sq);
    std::vector<float> t(static_cast<size_t>(n));
    for (int k = 0; k < n; ++k) t[size_t(k)] = float(q[size_t(k)] * norm);
    return t;
  }();
  return table;
}

// Draws [start, start + n) of the normal stream `key`, times stddev plus mean.
// Draw i is digit i % 5 of hash i / 5, so any split across threads agrees.
void fill_normal(uint64_t key, int64_t start, int64_t n, float mean, float stddev, float* out) {
  const float* table = normal_table().data();
  constexpr uint64_t kMask = (1u << kNormalBits) - 1;
  const int64_t end = start + n;
  int64_t group = start / kDrawsPerHash, i = start;
  auto partial = [&](int64_t from_digit) {  // digits from_digit.. of one hash, stopping at end
    uint64_t bits = mix64(key + uint64_t(group++) * kGolden) >> (kNormalBits * from_digit);
    for (int64_t j = from_digit; j < kDrawsPerHash && i < end; ++j, ++i, bits >>= kNormalBits)
      *out++ = mean + stddev * table[bits & kMask];
  };
  if (i % kDrawsPerHash != 0) partial(i % kDrawsPerHash);
  for (; i + kDrawsPerHash <= end; i += kDrawsPerHash, out += kDrawsPerHash) {
    uint64_t bits = mix64(key + uint64_t(group++) * kGolden);
    for (int j = 0; j < kDrawsPerHash; ++j, bits >>= kNormalBits) out[j] = mean + stddev * table[bits & kMask];
  }
  if (i < end) partial(0);
}

// Largest |x| of a block, compared as bit patterns: for non-negative floats
// the integer order is the float order, and inf/NaN land above 0x7f7fffff.
// (Integer max vectorizes where a float max reduction may not.)
uint32_t block_amax_bits(const float* band, int64_t stride, int64_t rows, int64_t c0, int64_t c1) {
  int32_t amax = 0;
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = band + r * stride;
    for (int64_t c = c0; c < c1; ++c) amax = std::max(amax, int32_t(std::bit_cast<uint32_t>(row[c]) & 0x7fffffffu));
  }
  return uint32_t(amax);
}

// Quantizes rows [r0, r0 + n) of a row-major matrix into `m` (codes and scales).
void quantize_band(const float* band, int64_t r0, int64_t n, WeightMatrix& m) {
  const int64_t sc = m.scale_cols();
  for (int64_t cb = 0; cb < sc; ++cb) {
    const int64_t c0 = cb * kBlock, c1 = std::min(m.cols, c0 + kBlock);
    const uint32_t amax_bits = block_amax_bits(band, m.cols, n, c0, c1);
    if (amax_bits >= 0x7f800000u)  // synthetic weights are finite: this throws outside OpenMP regions only
      throw Error(m.name + ": cannot quantize a non-finite value (block " + std::to_string(r0 / kBlock) + ", " +
                  std::to_string(cb) + ")");
    const int e = pow2_scale_exponent(std::bit_cast<float>(amax_bits), kFp8AmaxFloor, kE4m3Max);
    const float inv = std::ldexp(1.0f, -e);  // exact: dividing by 2^e
    for (int64_t r = 0; r < n; ++r) {
      const float* in = band + r * m.cols;
      uint8_t* out = m.owned.data() + (r0 + r) * m.cols;
      for (int64_t c = c0; c < c1; ++c) out[c] = float_to_e4m3(in[c] * inv);
    }
    m.block_scales[size_t((r0 / kBlock) * sc + cb)] = std::ldexp(1.0f, e);
  }
}

WeightMatrix fp8_shell(std::string name, int64_t rows, int64_t cols) {
  WeightMatrix m;
  m.name = std::move(name);
  m.rows = rows, m.cols = cols;
  m.dtype = DType::kF8E4M3;
  resize_on_huge_pages(m.owned, size_t(rows * cols));
  m.block_scales.resize(size_t(((rows + kBlock - 1) / kBlock) * m.scale_cols()));
  m.data = m.owned;
  return m;
}

class RandomSource : public TensorSource {
 public:
  RandomSource(uint64_t seed, bool fp8) : seed_(seed), fp8_(fp8) {}

  // Entries ~ N(0, 1/in) so that x W^T keeps unit-scale inputs at unit scale.
  WeightMatrix matrix(const TensorSpec& spec) override {
    const int64_t rows = spec.shape[0], cols = spec.shape[1];
    const uint64_t key = key_of(spec);
    const float stddev = 1.0f / std::sqrt(float(cols));
    if (fp8_ && spec.kind == TensorKind::kFp8Matrix) return fp8_matrix(spec.name, rows, cols, key, stddev);
    WeightMatrix m;
    m.name = spec.name;
    m.rows = rows, m.cols = cols;
    m.dtype = DType::kBF16;
    resize_on_huge_pages(m.owned, size_t(rows * cols) * 2);
    uint8_t* out = m.owned.data();
#pragma omp parallel for schedule(static) if (rows * cols > (1 << 16))
    for (int64_t r = 0; r < rows; ++r) {
      std::vector<float> row(static_cast<size_t>(cols));
      fill_normal(key, r * cols, cols, 0.0f, stddev, row.data());
      for (int64_t c = 0; c < cols; ++c) {
        const uint16_t b = bf16_bits(row[size_t(c)]);
        std::memcpy(out + 2 * (r * cols + c), &b, 2);
      }
    }
    m.data = m.owned;
    return m;
  }

  // Norm weights ~ 1 (stored bf16 in real checkpoints); sink ~ N(0, 0.25); ape ~ N(0, 0.01).
  std::vector<float> floats(const TensorSpec& spec) override {
    const bool sink = spec.name.ends_with("attn_sink");
    const float mean = spec.kind == TensorKind::kVector ? 1.0f : 0.0f;
    const float stddev = spec.kind == TensorKind::kVector ? 0.1f : sink ? 0.5f : 0.1f;
    std::vector<float> v(size_t(numel(spec.shape)));
    fill_normal(key_of(spec), 0, int64_t(v.size()), mean, stddev, v.data());
    if (spec.kind == TensorKind::kVector) round_bf16(v.data(), v.size());
    return v;
  }

 private:
  uint64_t key_of(const TensorSpec& spec) const { return mix64(seed_ ^ name_hash(spec.name)); }

  // Draws 128-row bands and quantizes each: the fp8 matrix rounds the same
  // values the bf16 variant of this seed rounds.
  static WeightMatrix fp8_matrix(const std::string& name, int64_t rows, int64_t cols, uint64_t key, float stddev) {
    WeightMatrix m = fp8_shell(name, rows, cols);
    const int64_t bands = (rows + kBlock - 1) / kBlock;
#pragma omp parallel for schedule(static) if (rows * cols > (1 << 16))
    for (int64_t b = 0; b < bands; ++b) {
      const int64_t r0 = b * kBlock, n = std::min(kBlock, rows - r0);
      std::vector<float> band(size_t(n * cols));
      fill_normal(key, r0 * cols, n * cols, 0.0f, stddev, band.data());
      quantize_band(band.data(), r0, n, m);
    }
    return m;
  }

  uint64_t seed_;
  bool fp8_;
};

// ---- assembling a layer ----------------------------------------------------------

class SpecTable {
 public:
  explicit SpecTable(std::vector<TensorSpec> specs) {
    for (auto& s : specs) by_name_.emplace(s.name, std::move(s));
  }
  const TensorSpec& operator[](const std::string& name) const { return by_name_.at(name); }

 private:
  std::map<std::string, TensorSpec> by_name_;
};

CompressorWeights compressor(TensorSource& src, const SpecTable& specs, const std::string& p, int ratio, int dim) {
  CompressorWeights c;
  c.ratio = ratio;
  c.dim = dim;
  c.coff = ratio == 4 ? 2 : 1;
  c.wkv = src.matrix(specs[p + "wkv.weight"]);
  c.wgate = src.matrix(specs[p + "wgate.weight"]);
  c.ape = src.floats(specs[p + "ape"]);
  c.norm = src.floats(specs[p + "norm.weight"]);
  return c;
}

LayerWeights assemble(const ModelConfig& config, int layer, TensorSource& src) {
  const SpecTable specs(attention_tensor_specs(config, layer));
  const std::string p = layer_prefix(layer);
  LayerWeights w;
  w.layer = layer;
  w.type = config.layer_type(layer);
  w.wq_a = src.matrix(specs[p + "wq_a.weight"]);
  w.wq_b = src.matrix(specs[p + "wq_b.weight"]);
  w.wkv = src.matrix(specs[p + "wkv.weight"]);
  w.wo_a = src.matrix(specs[p + "wo_a.weight"]);
  w.wo_b = src.matrix(specs[p + "wo_b.weight"]);
  w.q_norm = src.floats(specs[p + "q_norm.weight"]);
  w.kv_norm = src.floats(specs[p + "kv_norm.weight"]);
  w.attn_sink = src.floats(specs[p + "attn_sink"]);
  if (w.type != LayerType::kSwaOnly)
    w.compressor = compressor(src, specs, p + "compressor.", compress_ratio(w.type), config.head_dim);
  if (w.type == LayerType::kC4A) {
    IndexerWeights ix;
    ix.wq_b = src.matrix(specs[p + "indexer.wq_b.weight"]);
    ix.weights_proj = src.matrix(specs[p + "indexer.weights_proj.weight"]);
    ix.compressor = compressor(src, specs, p + "indexer.compressor.", 4, config.index_head_dim);
    w.indexer = std::move(ix);
  }
  return w;
}

}  // namespace

std::string layer_prefix(int layer) { return "layers." + std::to_string(layer) + ".attn."; }

std::string scale_name(std::string_view weight_name) {
  constexpr std::string_view kSuffix = ".weight";
  if (weight_name.ends_with(kSuffix)) weight_name.remove_suffix(kSuffix.size());
  return std::string(weight_name) + ".scale";
}

std::vector<TensorSpec> attention_tensor_specs(const ModelConfig& config, int layer) {
  DSV4_REQUIRE(layer >= 0 && layer < int(config.compress_ratios.size()),
          config.name + ": layer " + std::to_string(layer) + " does not exist (" +
              std::to_string(config.compress_ratios.size()) + " layers)");
  const std::string p = layer_prefix(layer);
  const int64_t D = config.hidden_size, H = config.num_heads, q = config.q_lora_rank, hd = config.head_dim;
  const int64_t G = config.o_groups, o = config.o_lora_rank, nI = config.index_n_heads, ihd = config.index_head_dim;
  std::vector<TensorSpec> s = {
      {p + "wq_a.weight", {q, D}, TensorKind::kFp8Matrix},
      {p + "q_norm.weight", {q}, TensorKind::kVector},
      {p + "wq_b.weight", {H * hd, q}, TensorKind::kFp8Matrix},
      {p + "wkv.weight", {hd, D}, TensorKind::kFp8Matrix},
      {p + "kv_norm.weight", {hd}, TensorKind::kVector},
      {p + "wo_a.weight", {G * o, H * hd / G}, TensorKind::kFp8Matrix},
      {p + "wo_b.weight", {D, G * o}, TensorKind::kFp8Matrix},
      {p + "attn_sink", {H}, TensorKind::kF32},
  };
  const LayerType type = config.layer_type(layer);
  if (type != LayerType::kSwaOnly) add_compressor(s, p + "compressor.", compress_ratio(type), hd, D);
  if (type == LayerType::kC4A) {
    s.push_back({p + "indexer.wq_b.weight", {nI * ihd, q}, TensorKind::kFp8Matrix});
    s.push_back({p + "indexer.weights_proj.weight", {nI, D}, TensorKind::kDenseMatrix});
    add_compressor(s, p + "indexer.compressor.", 4, ihd, D);
  }
  return s;
}

// ---- WeightMatrix ------------------------------------------------------------------

WeightMatrix::WeightMatrix(const WeightMatrix& other)
    : name(other.name),
      rows(other.rows),
      cols(other.cols),
      dtype(other.dtype),
      data(other.data),
      owned(other.owned),
      block_scales(other.block_scales) {
  if (!other.owned.empty() && other.data.data() == other.owned.data()) data = owned;
}

WeightMatrix& WeightMatrix::operator=(const WeightMatrix& other) {
  if (this != &other) *this = WeightMatrix(other);
  return *this;
}

float WeightMatrix::at(int64_t r, int64_t c) const {
  const size_t i = size_t(r * cols + c);
  switch (dtype) {
    case DType::kF8E4M3:
      return e4m3_to_float(data[i]) * block_scales[size_t((r / kBlock) * scale_cols() + c / kBlock)];
    case DType::kBF16: {
      uint16_t b;
      std::memcpy(&b, data.data() + 2 * i, 2);
      return bf16_to_float(b);
    }
    case DType::kF32: {
      float f;
      std::memcpy(&f, data.data() + 4 * i, 4);
      return f;
    }
    default:
      throw Error(name + ": matrices are F8_E4M3, BF16 or F32, not " + std::string(dtype_name(dtype)));
  }
}

void WeightMatrix::dequantize_rows(int64_t r0, int64_t n, float* out) const {
  DSV4_REQUIRE(dtype == DType::kF8E4M3 || dtype == DType::kBF16 || dtype == DType::kF32,
          name + ": matrices are F8_E4M3, BF16 or F32, not " + std::string(dtype_name(dtype)));
  DSV4_REQUIRE(r0 >= 0 && n >= 0 && r0 + n <= rows, name + ": rows out of range");
  // Without float32 copies every call dequantizes its weight panels, so this
  // loop is the CPU's hot one (a V4-Flash decode step: 17.6 s, 50% of it here):
  // codes through a table, one loop per dtype (no per-element switch).
  const float* e4m3 = e4m3_values();
#pragma omp parallel for schedule(static) if (n * cols > (1 << 16))
  for (int64_t r = r0; r < r0 + n; ++r) {
    float* o = out + (r - r0) * cols;
    const uint8_t* src = data.data() + size_t(r * cols) * dtype_size(dtype);
    if (dtype == DType::kF8E4M3) {
      const float* scales = block_scales.data() + size_t((r / kBlock) * scale_cols());
      for (int64_t c0 = 0; c0 < cols; c0 += kBlock) {  // one scale per 128 columns
        const float s = scales[c0 / kBlock];
        const int64_t c1 = std::min(cols, c0 + kBlock);
        for (int64_t c = c0; c < c1; ++c) o[c] = e4m3[src[c]] * s;
      }
    } else if (dtype == DType::kBF16) {
      for (int64_t c = 0; c < cols; ++c) o[c] = bf16_to_float(uint16_t(src[2 * c] | (src[2 * c + 1] << 8)));
    } else {
      std::memcpy(o, src, size_t(cols) * sizeof(float));
    }
  }
}

std::vector<float> WeightMatrix::dequantize() const {
  std::vector<float> out(size_t(rows * cols));
  dequantize_rows(0, rows, out.data());
  return out;
}

WeightMatrix quantize_fp8_matrix(std::string name, std::span<const float> values, int64_t rows, int64_t cols) {
  DSV4_REQUIRE(rows >= 0 && cols >= 0 && values.size() == size_t(rows * cols), name + ": " + std::to_string(values.size()) +
                                                                              " values for a [" + std::to_string(rows) +
                                                                              ", " + std::to_string(cols) + "] matrix");
  WeightMatrix m = fp8_shell(std::move(name), rows, cols);
  for (int64_t r0 = 0; r0 < rows; r0 += kBlock)
    quantize_band(values.data() + r0 * cols, r0, std::min(kBlock, rows - r0), m);
  return m;
}

namespace {

// Scans stored elements; `bad(i)` says whether element i is not finite.
template <typename Bad>
void scan(const std::string& name, int64_t n, Bad bad, const std::function<float(int64_t)>& value,
          std::vector<NonFiniteTensor>& out) {
  NonFiniteTensor t{name, 0, n, 0, 0};
  for (int64_t i = 0; i < n; ++i)
    if (bad(i) && t.count++ == 0) t.first_index = i;
  if (t.count == 0) return;
  t.first_value = value(t.first_index);
  out.push_back(std::move(t));
}

void scan_matrix(const WeightMatrix& m, std::vector<NonFiniteTensor>& out) {
  const int64_t n = m.rows * m.cols;
  const uint8_t* p = m.data.data();
  auto value = [&](int64_t i) { return m.at(i / m.cols, i % m.cols); };
  switch (m.dtype) {
    case DType::kF8E4M3:  // e4m3fn: no infinities; S.1111.111 is NaN
      scan(m.name, n, [&](int64_t i) { return (p[i] & 0x7f) == 0x7f; }, value, out);
      break;
    case DType::kBF16:
      scan(m.name, n, [&](int64_t i) { return (p[2 * i + 1] & 0x7f) == 0x7f && (p[2 * i] & 0x80); }, value, out);
      break;
    case DType::kF32:
      scan(m.name, n, [&](int64_t i) { return (p[4 * i + 3] & 0x7f) == 0x7f && (p[4 * i + 2] & 0x80); }, value, out);
      break;
    default:
      break;  // refused at load
  }
}

void scan_floats(const std::string& name, const std::vector<float>& v, std::vector<NonFiniteTensor>& out) {
  scan(name, int64_t(v.size()), [&](int64_t i) { return !std::isfinite(v[size_t(i)]); },
       [&](int64_t i) { return v[size_t(i)]; }, out);
}

void scan_compressor(const std::string& p, const CompressorWeights& c, std::vector<NonFiniteTensor>& out) {
  scan_matrix(c.wkv, out);
  scan_matrix(c.wgate, out);
  scan_floats(p + "ape", c.ape, out);
  scan_floats(p + "norm.weight", c.norm, out);
}

}  // namespace

std::vector<NonFiniteTensor> find_nonfinite(const LayerWeights& w) {
  const std::string p = layer_prefix(w.layer);
  std::vector<NonFiniteTensor> out;
  scan_matrix(w.wq_a, out);
  scan_floats(p + "q_norm.weight", w.q_norm, out);
  scan_matrix(w.wq_b, out);
  scan_matrix(w.wkv, out);
  scan_floats(p + "kv_norm.weight", w.kv_norm, out);
  scan_matrix(w.wo_a, out);
  scan_matrix(w.wo_b, out);
  scan_floats(p + "attn_sink", w.attn_sink, out);
  if (w.compressor) scan_compressor(p + "compressor.", *w.compressor, out);
  if (w.indexer) {
    scan_matrix(w.indexer->wq_b, out);
    scan_matrix(w.indexer->weights_proj, out);
    scan_compressor(p + "indexer.compressor.", w.indexer->compressor, out);
  }
  return out;
}

int64_t stored_bytes(const LayerWeights& w) {
  const auto matrix = [](const WeightMatrix& m) { return int64_t(m.data.size() + 4 * m.block_scales.size()); };
  const auto floats = [](const std::vector<float>& v) { return int64_t(4 * v.size()); };
  const auto compressor = [&](const CompressorWeights& c) {
    return matrix(c.wkv) + matrix(c.wgate) + floats(c.ape) + floats(c.norm);
  };
  int64_t n = matrix(w.wq_a) + matrix(w.wq_b) + matrix(w.wkv) + matrix(w.wo_a) + matrix(w.wo_b) + floats(w.q_norm) +
              floats(w.kv_norm) + floats(w.attn_sink);
  if (w.compressor) n += compressor(*w.compressor);
  if (w.indexer) n += matrix(w.indexer->wq_b) + matrix(w.indexer->weights_proj) + compressor(w.indexer->compressor);
  return n;
}

LayerWeights load_layer_weights(const Checkpoint& ckpt, const ModelConfig& config, int layer) {
  CheckpointSource src(ckpt);
  return assemble(config, layer, src);
}

LayerWeights random_layer_weights(const ModelConfig& config, int layer, uint64_t seed, bool fp8) {
  RandomSource src(seed, fp8);
  return assemble(config, layer, src);
}

}  // namespace dsv4
