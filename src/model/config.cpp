#include "model/config_json.h"

#include <fstream>

#include <nlohmann/json.hpp>

#include "common/error.h"

namespace dsv4 {

std::string_view layer_type_name(LayerType t) {
  switch (t) {
    case LayerType::kSwaOnly: return "swaonly";
    case LayerType::kC4A: return "c4a";
    case LayerType::kC128A: return "c128a";
  }
  return "?";
}

LayerType layer_type_from_ratio(int ratio) {
  if (ratio == 0 || ratio == 1) return LayerType::kSwaOnly;
  if (ratio == 4) return LayerType::kC4A;
  if (ratio == 128) return LayerType::kC128A;
  throw Error("unknown compress ratio " + std::to_string(ratio) + " (expected 0, 4 or 128)");
}

int compress_ratio(LayerType t) {
  switch (t) {
    case LayerType::kSwaOnly: return 1;
    case LayerType::kC4A: return 4;
    case LayerType::kC128A: return 128;
  }
  return 1;
}

int ModelConfig::count_layers(LayerType t) const {
  int n = 0;
  for (int i = 0; i < num_layers; ++i) n += layer_type(i) == t;
  return n;
}

RopeParams ModelConfig::rope_params(LayerType t) const {
  if (t == LayerType::kSwaOnly) return RopeParams{rope_theta, false, yarn};
  return RopeParams{compress_rope_theta, true, yarn};
}

void ModelConfig::validate() const {
  auto positive = [&](int v, const char* field) {
    DSV4_REQUIRE(v > 0, name + ": " + field + " must be positive (got " + std::to_string(v) + ")");
  };
  positive(hidden_size, "hidden_size");
  positive(num_layers, "num_hidden_layers");
  positive(num_heads, "num_attention_heads");
  positive(q_lora_rank, "q_lora_rank");
  positive(o_groups, "o_groups");
  positive(o_lora_rank, "o_lora_rank");
  positive(index_n_heads, "index_n_heads");
  positive(index_topk, "index_topk");
  DSV4_REQUIRE(head_dim == 512, name + ": head_dim must be 512 (got " + std::to_string(head_dim) + ")");
  DSV4_REQUIRE(rope_dim == 64, name + ": qk_rope_head_dim must be 64 (got " + std::to_string(rope_dim) + ")");
  DSV4_REQUIRE(index_head_dim == 128,
          name + ": index_head_dim must be 128 (got " + std::to_string(index_head_dim) + ")");
  DSV4_REQUIRE(sliding_window == 128,
          name + ": sliding_window must be 128 (got " + std::to_string(sliding_window) + ")");
  DSV4_REQUIRE(num_heads % o_groups == 0, name + ": num_attention_heads (" + std::to_string(num_heads) +
                                         ") is not divisible by o_groups (" + std::to_string(o_groups) + ")");
  // FP8 activations are quantized in 128-wide blocks along every GEMM input.
  DSV4_REQUIRE(hidden_size % 128 == 0, name + ": hidden_size must be a multiple of 128");
  DSV4_REQUIRE(q_lora_rank % 128 == 0, name + ": q_lora_rank must be a multiple of 128");
  DSV4_REQUIRE(o_lora_rank % 128 == 0 || (o_groups * o_lora_rank) % 128 == 0,
          name + ": o_groups * o_lora_rank must be a multiple of 128");
  DSV4_REQUIRE(rms_norm_eps > 0, name + ": rms_norm_eps must be positive");
  DSV4_REQUIRE(max_position_embeddings > 0, name + ": max_position_embeddings must be positive");
  DSV4_REQUIRE(rope_theta > 1 && compress_rope_theta > 1, name + ": rope_theta and compress_rope_theta must be > 1");
  DSV4_REQUIRE(yarn.factor >= 1 && yarn.original_max_position > 0,
          name + ": rope_scaling needs factor >= 1 and original_max_position_embeddings > 0");
  DSV4_REQUIRE(int(compress_ratios.size()) == num_layers,
          name + ": compress_ratios has " + std::to_string(compress_ratios.size()) + " entries for " +
              std::to_string(num_layers) + " layers");
  for (size_t i = 0; i < compress_ratios.size(); ++i) {
    try {
      layer_type_from_ratio(compress_ratios[i]);
    } catch (const Error& e) {
      throw Error(name + ": compress_ratios[" + std::to_string(i) + "]: " + e.what());
    }
  }
}

namespace {

std::vector<int> flash_ratios() {
  std::vector<int> r = {0, 0};
  for (int i = 0; i < 20; ++i) r.insert(r.end(), {4, 128});
  r.push_back(4);  // layer 42; the MTP entry (0) is not part of the stack
  return r;
}

std::vector<int> pro_ratios() {
  std::vector<int> r = {128, 128};
  for (int i = 0; i < 29; ++i) r.insert(r.end(), {4, 128});
  r.push_back(4);
  return r;
}

}  // namespace

ModelConfig preset_config(std::string_view name) {
  ModelConfig c;
  c.name = std::string(name);
  c.fp8_weights = true;
  if (name == "flash") {
    c.hidden_size = 4096, c.num_layers = 43, c.num_heads = 64, c.q_lora_rank = 1024;
    c.o_groups = 8, c.o_lora_rank = 1024, c.index_n_heads = 64, c.index_topk = 512;
    c.compress_ratios = flash_ratios();
  } else if (name == "pro") {
    c.hidden_size = 7168, c.num_layers = 61, c.num_heads = 128, c.q_lora_rank = 1536;
    c.o_groups = 16, c.o_lora_rank = 1024, c.index_n_heads = 64, c.index_topk = 1024;
    c.compress_ratios = pro_ratios();
  } else if (name == "mini") {
    c.hidden_size = 256, c.num_layers = 3, c.num_heads = 4, c.q_lora_rank = 128;
    c.o_groups = 2, c.o_lora_rank = 64, c.index_n_heads = 4, c.index_topk = 64;
    c.compress_ratios = {0, 4, 128};
  } else if (name == "small") {
    // Flash's structure at a size two CPU cores run in seconds: the default of `dsv4 run`.
    c.hidden_size = 1024, c.num_layers = 8, c.num_heads = 16, c.q_lora_rank = 256;
    c.o_groups = 4, c.o_lora_rank = 256, c.index_n_heads = 16, c.index_topk = 128;
    c.compress_ratios = {0, 4, 128, 4, 128, 4, 128, 4};
  } else {
    throw Error("unknown preset '" + std::string(name) + "' (expected flash, pro, mini or small)");
  }
  c.validate();
  return c;
}

namespace {

// Typed field access with errors that name the field.
template <typename T>
T get_field(const nlohmann::json& j, const char* field, const std::string& origin) {
  auto it = j.find(field);
  DSV4_REQUIRE(it != j.end() && !it->is_null(), origin + ": missing field '" + field + "'");
  try {
    return it->get<T>();
  } catch (const nlohmann::json::exception&) {
    throw Error(origin + ": field '" + field + "' has the wrong type (" + it->type_name() + ")");
  }
}

template <typename T>
T get_field_or(const nlohmann::json& j, const char* field, T fallback, const std::string& origin) {
  if (!j.contains(field) || j.at(field).is_null()) return fallback;
  return get_field<T>(j, field, origin);
}

std::vector<int> ratios_from_layer_types(const nlohmann::json& j, const std::string& origin) {
  const auto types = get_field<std::vector<std::string>>(j, "layer_types", origin);
  const auto rates = get_field_or<nlohmann::json>(j, "compress_rates", nlohmann::json::object(), origin);
  auto rate = [&](const char* key, int fallback) {
    return rates.contains(key) ? get_field<int>(rates, key, origin + ": compress_rates") : fallback;
  };
  std::vector<int> r;
  for (size_t i = 0; i < types.size(); ++i) {
    const std::string& t = types[i];
    if (t == "sliding_attention") r.push_back(0);
    else if (t == "compressed_sparse_attention") r.push_back(rate("compressed_sparse_attention", 4));
    else if (t == "heavily_compressed_attention") r.push_back(rate("heavily_compressed_attention", 128));
    else throw Error(origin + ": layer_types[" + std::to_string(i) + "]: unknown layer type '" + t + "'");
  }
  return r;
}

}  // namespace

ModelConfig config_from_json(const nlohmann::json& j, const std::string& origin) {
  DSV4_REQUIRE(j.is_object(), origin + ": expected a JSON object");
  ModelConfig c;
  c.name = origin;
  c.hidden_size = get_field<int>(j, "hidden_size", origin);
  c.num_layers = get_field<int>(j, "num_hidden_layers", origin);
  c.num_heads = get_field<int>(j, "num_attention_heads", origin);
  c.head_dim = get_field<int>(j, "head_dim", origin);
  c.rope_dim = get_field<int>(j, "qk_rope_head_dim", origin);
  c.q_lora_rank = get_field<int>(j, "q_lora_rank", origin);
  c.o_groups = get_field<int>(j, "o_groups", origin);
  c.o_lora_rank = get_field<int>(j, "o_lora_rank", origin);
  c.sliding_window = get_field<int>(j, "sliding_window", origin);
  c.index_n_heads = get_field<int>(j, "index_n_heads", origin);
  c.index_head_dim = get_field<int>(j, "index_head_dim", origin);
  c.index_topk = get_field<int>(j, "index_topk", origin);
  c.rope_theta = get_field<double>(j, "rope_theta", origin);
  c.compress_rope_theta = get_field<double>(j, "compress_rope_theta", origin);
  c.rms_norm_eps = get_field_or<double>(j, "rms_norm_eps", 1e-6, origin);
  c.max_position_embeddings = get_field<int64_t>(j, "max_position_embeddings", origin);
  const int kv_heads = get_field_or<int>(j, "num_key_value_heads", 1, origin);
  DSV4_REQUIRE(kv_heads == 1, origin + ": num_key_value_heads must be 1 (one shared KV head), got " +
                             std::to_string(kv_heads));

  const auto rs = get_field<nlohmann::json>(j, "rope_scaling", origin);
  const std::string rs_origin = origin + ": rope_scaling";
  const auto type = get_field_or<std::string>(rs, "type", get_field_or<std::string>(rs, "rope_type", "yarn", rs_origin),
                                              rs_origin);
  DSV4_REQUIRE(type == "yarn", rs_origin + ": type must be 'yarn' (got '" + type + "')");
  c.yarn.factor = get_field<double>(rs, "factor", rs_origin);
  c.yarn.original_max_position = get_field<int64_t>(rs, "original_max_position_embeddings", rs_origin);
  c.yarn.beta_fast = get_field_or<double>(rs, "beta_fast", 32, rs_origin);
  c.yarn.beta_slow = get_field_or<double>(rs, "beta_slow", 1, rs_origin);

  std::vector<int> ratios;
  if (j.contains("compress_ratios")) ratios = get_field<std::vector<int>>(j, "compress_ratios", origin);
  else if (j.contains("layer_types")) ratios = ratios_from_layer_types(j, origin);
  else throw Error(origin + ": missing field 'compress_ratios' (or 'layer_types')");
  // Flash/Pro list one more entry than there are layers: the MTP block's.
  DSV4_REQUIRE(int(ratios.size()) >= c.num_layers,
          origin + ": compress_ratios has " + std::to_string(ratios.size()) + " entries for " +
              std::to_string(c.num_layers) + " layers");
  ratios.resize(size_t(c.num_layers));
  c.compress_ratios = ratios;

  if (j.contains("quantization_config") && !j.at("quantization_config").is_null()) {
    const auto q = j.at("quantization_config");
    const std::string q_origin = origin + ": quantization_config";
    const auto method = get_field_or<std::string>(q, "quant_method", "fp8", q_origin);
    DSV4_REQUIRE(method == "fp8", q_origin + ": quant_method must be 'fp8' (got '" + method + "')");
    const auto block = get_field_or<std::vector<int>>(q, "weight_block_size", {128, 128}, q_origin);
    DSV4_REQUIRE(block == std::vector<int>({128, 128}), q_origin + ": weight_block_size must be [128, 128]");
    c.fp8_weights = true;
  }
  c.validate();
  return c;
}

nlohmann::json read_json_file(const std::filesystem::path& path) {
  std::ifstream in(path);
  DSV4_REQUIRE(bool(in), "cannot open '" + path.string() + "'");
  try {
    return nlohmann::json::parse(in);
  } catch (const nlohmann::json::parse_error& e) {
    throw Error(path.string() + ": invalid JSON: " + e.what());
  }
}

ModelConfig load_config(const std::filesystem::path& path) { return config_from_json(read_json_file(path), path.string()); }

}  // namespace dsv4
