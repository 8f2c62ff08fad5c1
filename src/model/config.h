#pragma once
// The model configuration of SPEC §2: what a DeepSeek-V4 config.json says
// about the attention stack, validated, plus built-in presets.
#include <cstdint>
#include <filesystem>
#include <string>
#include <string_view>
#include <vector>

#include "numerics/rope.h"

namespace dsv4 {

// SPEC §1: the layer type follows from the compress ratio m.
enum class LayerType { kSwaOnly, kC4A, kC128A };
inline constexpr int kNumLayerTypes = 3;

std::string_view layer_type_name(LayerType t);  // "swaonly", "c4a", "c128a"
// 0 or 1 -> swaonly, 4 -> c4a, 128 -> c128a; anything else throws Error.
LayerType layer_type_from_ratio(int ratio);
int compress_ratio(LayerType t);  // 1, 4, 128

// Bounds validate() enforces beyond SPEC §2's fixed dims, so that every GEMM
// dimension fits a 32-bit int and every tensor's byte count 64 bits (Pro:
// hidden 7168, 128 heads, 61 layers, 1M positions).
inline constexpr int kMaxModelWidth = 1 << 20;  // hidden_size, ranks, o_groups * o_lora_rank, index_topk
inline constexpr int kMaxHeads = 1 << 12;       // num_attention_heads, o_groups, index_n_heads
inline constexpr int kMaxLayers = 1 << 12;
inline constexpr int64_t kMaxPositions = (int64_t(1) << 31) - 1;  // positions fit int32
// The FP8 block width of weights and of linear inputs (SPEC §5).
inline constexpr int kFp8BlockWidth = 128;

struct ModelConfig {
  std::string name;  // preset name or the file it came from
  int hidden_size = 0;
  int num_layers = 0;
  int num_heads = 0;
  int head_dim = 512;
  int rope_dim = 64;
  int q_lora_rank = 0;
  int o_groups = 0;
  int o_lora_rank = 0;
  int sliding_window = 128;
  int index_n_heads = 0;
  int index_head_dim = 128;
  int index_topk = 0;
  double rope_theta = 10000;
  double compress_rope_theta = 160000;
  YarnParams yarn;
  double rms_norm_eps = 1e-6;
  int64_t max_position_embeddings = 1 << 20;
  std::vector<int> compress_ratios;  // one per attention layer (num_layers entries)
  bool fp8_weights = false;          // quantization_config says fp8 e4m3 with 128x128 blocks

  LayerType layer_type(int layer) const { return layer_type_from_ratio(compress_ratios.at(size_t(layer))); }
  int count_layers(LayerType t) const;
  // RoPE of a layer: base 10000 plain for SWA-only, 160000 with YaRN otherwise.
  RopeParams rope_params(LayerType t) const;

  // Throws Error naming the offending field. Checks what every profile needs
  // (the exact profile accepts any width, as the reference does).
  void validate() const;
};

// What the production profile needs beyond validate(): every FP8 linear's
// input width (hidden_size, q_lora_rank, o_groups * o_lora_rank) a multiple
// of 128. Throws Error naming the field, its value and the profile. Call it
// before building anything that runs production numerics.
void check_production_dims(const ModelConfig& config);

// Built-in presets: "flash", "pro", "mini" (the golden vectors' dims), "small"
// (Flash's layer mix scaled down for CPU runs).
ModelConfig preset_config(std::string_view name);

// Reads and validates a config.json (either spelling of the layer schedule,
// SPEC §2); the JSON-level entry points are in model/config_json.h.
ModelConfig load_config(const std::filesystem::path& path);

}  // namespace dsv4
