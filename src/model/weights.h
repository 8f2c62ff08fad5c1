#pragma once
// One attention layer's weights under the official names of SPEC §3, as the
// stack consumes them: FP8 matrices stay FP8 + block scales (what kernels
// read), and can be dequantized to float; bf16/fp32 checkpoints are accepted.
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "model/config.h"
#include "model/safetensors.h"

namespace dsv4 {

// What SPEC §3 expects of one tensor.
enum class TensorKind {
  kFp8Matrix,   // float8_e4m3fn + ".scale" (e8m0 or f32) per 128x128 block; or bf16/f32 dequantized
  kDenseMatrix, // bf16 or f32 matrix
  kVector,      // bf16 or f32 vector (norm weights)
  kF32,         // fp32 in real checkpoints (attn_sink, ape); bf16 accepted
};

struct TensorSpec {
  std::string name;  // full name, e.g. "layers.3.attn.wq_b.weight"
  std::vector<int64_t> shape;
  TensorKind kind;
};

std::string layer_prefix(int layer);  // "layers.{i}.attn."
// The block-scale companion of an FP8 weight: "x.weight" -> "x.scale".
std::string scale_name(std::string_view weight_name);
// Every tensor SPEC §3 lists for this layer, with its expected shape.
std::vector<TensorSpec> attention_tensor_specs(const ModelConfig& config, int layer);

// A matrix [rows, cols] in its stored form.
struct WeightMatrix {
  std::string name;
  int64_t rows = 0, cols = 0;
  DType dtype = DType::kF32;          // kF8E4M3, kBF16 or kF32
  std::span<const uint8_t> data;      // rows * cols elements (points into `owned` or a mapped file)
  std::vector<uint8_t> owned;         // storage for synthetic weights
  std::vector<float> block_scales;    // FP8 only: [ceil(rows/128), ceil(cols/128)], row-major

  WeightMatrix() = default;
  // A copy of a synthetic matrix points `data` at its own copy of `owned`.
  WeightMatrix(const WeightMatrix& other);
  WeightMatrix& operator=(const WeightMatrix& other);
  // Moving a vector keeps its buffer, so `data` stays valid.
  WeightMatrix(WeightMatrix&&) noexcept = default;
  WeightMatrix& operator=(WeightMatrix&&) noexcept = default;

  bool is_fp8() const { return dtype == DType::kF8E4M3; }
  int64_t scale_cols() const { return (cols + 127) / 128; }
  // Element (r, c) as float: fp8 * its block scale, or the bf16/f32 value.
  float at(int64_t r, int64_t c) const;
  // Rows [r0, r0 + n), row-major, as float, into out[n * cols].
  void dequantize_rows(int64_t r0, int64_t n, float* out) const;
  // All elements, row-major, as float.
  std::vector<float> dequantize() const;
};

struct CompressorWeights {
  int ratio = 0;       // m: 4 or 128
  int dim = 0;         // c: 512 (main) or 128 (indexer)
  int coff = 1;        // k: 2 when m == 4 (overlap), else 1
  WeightMatrix wkv;    // [k*c, D]
  WeightMatrix wgate;  // [k*c, D]
  std::vector<float> ape;   // [m, k*c]
  std::vector<float> norm;  // [c]
};

struct IndexerWeights {
  WeightMatrix wq_b;          // [nI*128, q_lora]
  WeightMatrix weights_proj;  // [nI, D]
  CompressorWeights compressor;
};

struct LayerWeights {
  int layer = 0;
  LayerType type = LayerType::kSwaOnly;
  WeightMatrix wq_a, wq_b, wkv, wo_a, wo_b;
  std::vector<float> q_norm, kv_norm, attn_sink;
  std::optional<CompressorWeights> compressor;  // C4A and C128A
  std::optional<IndexerWeights> indexer;        // C4A only
};

// Bytes the layer's tensors take as stored: matrix elements, FP8 block
// scales and the float vectors (norms, sink, ape).
int64_t stored_bytes(const LayerWeights& w);

// Loads and validates one layer. A missing tensor, a wrong shape or a wrong
// dtype throws Error naming the tensor. The checkpoint must outlive the result.
LayerWeights load_layer_weights(const Checkpoint& ckpt, const ModelConfig& config, int layer);

// A tensor of a layer holding NaN or Inf values, as stored (an e4m3 NaN
// code, a bf16 or f32 NaN or Inf; block scales are checked at load).
struct NonFiniteTensor {
  std::string name;
  int64_t count = 0;        // non-finite elements
  int64_t numel = 0;        // elements in all
  int64_t first_index = 0;  // row-major index of the first one
  float first_value = 0;    // as decoded
};
// Every tensor of `w` holding non-finite values, in SPEC §3 order.
std::vector<NonFiniteTensor> find_nonfinite(const LayerWeights& w);

// Quantizes a row-major float matrix to e4m3 (stored in `owned`) with one
// power-of-two scale per 128x128 block, 2^ceil(log2(max(amax, 1e-4) / 448)):
// the UE8M0 block format of real checkpoints. Values must be finite.
WeightMatrix quantize_fp8_matrix(std::string name, std::span<const float> values, int64_t rows, int64_t cols);

// Synthetic weights drawn from `seed`, scaled so activations stay O(1), in the
// dtypes of a real checkpoint (FP8 + UE8M0 scales when fp8 is set, bf16
// otherwise; fp32 sink and ape): matrix entries ~ N(0, 1/in_features), norms
// ~ 1 + N(0, 0.01), attn_sink ~ N(0, 0.25), ape ~ N(0, 0.01). For one seed the
// fp8 and bf16 variants are two roundings of the same underlying values.
LayerWeights random_layer_weights(const ModelConfig& config, int layer, uint64_t seed, bool fp8);

}  // namespace dsv4
