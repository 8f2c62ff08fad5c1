#include "model/config_json.h"

#include <cmath>
#include <cstdio>
#include <limits>
#include <type_traits>

#include <nlohmann/json.hpp>

#include "common/error.h"
#include "model/files.h"
#include "model/json_reader.h"

namespace dsv4 {
namespace {

std::string number_string(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g", v);
  return buf;
}

}  // namespace

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
  auto in_range = [&](int64_t v, const char* field, int64_t hi) {
    DSV4_REQUIRE(v > 0, name + ": " + field + " must be positive (got " + std::to_string(v) + ")");
    DSV4_REQUIRE(v <= hi, name + ": " + field + " must be at most " + std::to_string(hi) + " (got " + std::to_string(v) + ")");
  };
  in_range(hidden_size, "hidden_size", kMaxModelWidth);
  in_range(num_layers, "num_hidden_layers", kMaxLayers);
  in_range(num_heads, "num_attention_heads", kMaxHeads);
  in_range(q_lora_rank, "q_lora_rank", kMaxModelWidth);
  in_range(o_groups, "o_groups", kMaxHeads);
  in_range(o_lora_rank, "o_lora_rank", kMaxModelWidth);
  in_range(index_n_heads, "index_n_heads", kMaxHeads);
  in_range(index_topk, "index_topk", kMaxModelWidth);
  DSV4_REQUIRE(head_dim == 512, name + ": head_dim must be 512 (got " + std::to_string(head_dim) + ")");
  DSV4_REQUIRE(rope_dim == 64, name + ": qk_rope_head_dim must be 64 (got " + std::to_string(rope_dim) + ")");
  DSV4_REQUIRE(index_head_dim == 128,
          name + ": index_head_dim must be 128 (got " + std::to_string(index_head_dim) + ")");
  DSV4_REQUIRE(sliding_window == 128,
          name + ": sliding_window must be 128 (got " + std::to_string(sliding_window) + ")");
  DSV4_REQUIRE(num_heads % o_groups == 0, name + ": num_attention_heads (" + std::to_string(num_heads) +
                                         ") is not divisible by o_groups (" + std::to_string(o_groups) + ")");
  // The width of wo_b's input; 64-bit, so that the product cannot overflow.
  const int64_t o_width = int64_t(o_groups) * o_lora_rank;
  DSV4_REQUIRE(o_width <= kMaxModelWidth, name + ": o_groups * o_lora_rank = " + std::to_string(o_width) +
                                         " must be at most " + std::to_string(kMaxModelWidth));
  // No multiple-of-128 rule here: the exact profile runs any width, as the
  // reference does; check_production_dims() states what FP8 blocks need.
  DSV4_REQUIRE(std::isfinite(rms_norm_eps) && rms_norm_eps > 0,
          name + ": rms_norm_eps must be positive and finite (got " + number_string(rms_norm_eps) + ")");
  in_range(max_position_embeddings, "max_position_embeddings", kMaxPositions);
  DSV4_REQUIRE(std::isfinite(rope_theta) && rope_theta > 1,
          name + ": rope_theta must be finite and > 1 (got " + number_string(rope_theta) + ")");
  DSV4_REQUIRE(std::isfinite(compress_rope_theta) && compress_rope_theta > 1,
          name + ": compress_rope_theta must be finite and > 1 (got " + number_string(compress_rope_theta) + ")");
  DSV4_REQUIRE(std::isfinite(yarn.factor) && yarn.factor >= 1,
          name + ": rope_scaling.factor must be finite and >= 1 (got " + number_string(yarn.factor) + ")");
  in_range(yarn.original_max_position, "rope_scaling.original_max_position_embeddings", kMaxPositions);
  DSV4_REQUIRE(std::isfinite(yarn.beta_fast) && std::isfinite(yarn.beta_slow),
          name + ": rope_scaling.beta_fast and beta_slow must be finite");
  DSV4_REQUIRE(int64_t(compress_ratios.size()) == num_layers,
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

void check_production_dims(const ModelConfig& c) {
  // Each FP8 linear quantizes its input row in 1x128 blocks (SPEC §5), so its
  // input width must be a whole number of blocks: wq_a and wkv read hidden_size
  // values, wq_b and indexer.wq_b q_lora_rank, wo_b o_groups * o_lora_rank.
  auto blocks = [&](int64_t v, const std::string& field, const char* readers) {
    DSV4_REQUIRE(v % kFp8BlockWidth == 0,
            c.name + ": " + field + " = " + std::to_string(v) + " is not a multiple of " +
                std::to_string(kFp8BlockWidth) + ", which the production profile needs: " + readers +
                " quantize their input in 1x" + std::to_string(kFp8BlockWidth) +
                " FP8 blocks (the exact profile runs any width)");
  };
  blocks(c.hidden_size, "hidden_size", "wq_a and wkv");
  blocks(c.q_lora_rank, "q_lora_rank", "wq_b and indexer.wq_b");
  blocks(int64_t(c.o_groups) * c.o_lora_rank,
         "o_groups * o_lora_rank (" + std::to_string(c.o_groups) + " * " + std::to_string(c.o_lora_rank) + ")",
         "wo_b");
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

// Field access with errors that name the field. Integers must be exact JSON
// integers (not 256.7, true or "256") that fit their type; numbers must be
// numbers (not true); nothing is converted silently.
const nlohmann::json* find_field(const nlohmann::json& j, const char* field) {
  const auto it = j.find(field);
  return it == j.end() || it->is_null() ? nullptr : &*it;
}

const nlohmann::json& need_field(const nlohmann::json& j, const char* field, const std::string& origin) {
  const nlohmann::json* v = find_field(j, field);
  DSV4_REQUIRE(v != nullptr, origin + ": missing field '" + field + "'");
  return *v;
}

[[noreturn]] void wrong_type(const nlohmann::json& v, const std::string& what, const char* expected) {
  std::string text = v.dump();
  if (text.size() > 60) text = text.substr(0, 60) + "...";
  throw Error(what + " has the wrong type: expected " + expected + ", got " + v.type_name() + " " + text);
}

template <typename T>
T exact_integer(const nlohmann::json& v, const std::string& what) {
  return T(json_integer(v, what, std::numeric_limits<T>::min(), std::numeric_limits<T>::max()));
}

std::string field_name(const std::string& origin, const char* field) { return origin + ": field '" + field + "'"; }

template <typename T = int>
T int_field(const nlohmann::json& j, const char* field, const std::string& origin) {
  return exact_integer<T>(need_field(j, field, origin), field_name(origin, field));
}

int int_field_or(const nlohmann::json& j, const char* field, int fallback, const std::string& origin) {
  return find_field(j, field) ? int_field(j, field, origin) : fallback;
}

double number_field(const nlohmann::json& j, const char* field, const std::string& origin) {
  const nlohmann::json& v = need_field(j, field, origin);
  if (!v.is_number()) wrong_type(v, field_name(origin, field), "a number");
  return v.get<double>();  // finite: the reader refuses numbers that overflow a double
}

double number_field_or(const nlohmann::json& j, const char* field, double fallback, const std::string& origin) {
  return find_field(j, field) ? number_field(j, field, origin) : fallback;
}

std::string string_field_or(const nlohmann::json& j, const char* field, const std::string& fallback,
                            const std::string& origin) {
  const nlohmann::json* v = find_field(j, field);
  if (!v) return fallback;
  if (!v->is_string()) wrong_type(*v, field_name(origin, field), "a string");
  return v->get<std::string>();
}

const nlohmann::json& object_field(const nlohmann::json& j, const char* field, const std::string& origin) {
  const nlohmann::json& v = need_field(j, field, origin);
  if (!v.is_object()) wrong_type(v, field_name(origin, field), "an object");
  return v;
}

const nlohmann::json& array_field(const nlohmann::json& j, const char* field, const std::string& origin) {
  const nlohmann::json& v = need_field(j, field, origin);
  if (!v.is_array()) wrong_type(v, field_name(origin, field), "an array");
  return v;
}

std::vector<int> int_list_field(const nlohmann::json& j, const char* field, const std::string& origin) {
  std::vector<int> out;
  const nlohmann::json& list = array_field(j, field, origin);
  for (size_t i = 0; i < list.size(); ++i)
    out.push_back(exact_integer<int>(list[i], origin + ": field '" + field + "[" + std::to_string(i) + "]'"));
  return out;
}

std::vector<int> ratios_from_layer_types(const nlohmann::json& j, const std::string& origin) {
  const nlohmann::json& types = array_field(j, "layer_types", origin);
  const nlohmann::json* rates = find_field(j, "compress_rates");
  if (rates && !rates->is_object()) wrong_type(*rates, field_name(origin, "compress_rates"), "an object");
  auto rate = [&](const char* key, int fallback) {
    return rates ? int_field_or(*rates, key, fallback, origin + ": compress_rates") : fallback;
  };
  std::vector<int> r;
  for (size_t i = 0; i < types.size(); ++i) {
    const std::string where = "layer_types[" + std::to_string(i) + "]";
    if (!types[i].is_string()) wrong_type(types[i], origin + ": field '" + where + "'", "a string");
    const std::string t = types[i].get<std::string>();
    if (t == "sliding_attention") r.push_back(0);
    else if (t == "compressed_sparse_attention") r.push_back(rate("compressed_sparse_attention", 4));
    else if (t == "heavily_compressed_attention") r.push_back(rate("heavily_compressed_attention", 128));
    else throw Error(origin + ": " + where + ": unknown layer type '" + t + "'");
  }
  return r;
}

}  // namespace

ModelConfig config_from_json(const nlohmann::json& j, const std::string& origin) {
  DSV4_REQUIRE(j.is_object(), origin + ": expected a JSON object (got " + std::string(j.type_name()) + ")");
  ModelConfig c;
  c.name = origin;
  c.hidden_size = int_field(j, "hidden_size", origin);
  c.num_layers = int_field(j, "num_hidden_layers", origin);
  c.num_heads = int_field(j, "num_attention_heads", origin);
  c.head_dim = int_field(j, "head_dim", origin);
  c.rope_dim = int_field(j, "qk_rope_head_dim", origin);
  c.q_lora_rank = int_field(j, "q_lora_rank", origin);
  c.o_groups = int_field(j, "o_groups", origin);
  c.o_lora_rank = int_field(j, "o_lora_rank", origin);
  c.sliding_window = int_field(j, "sliding_window", origin);
  c.index_n_heads = int_field(j, "index_n_heads", origin);
  c.index_head_dim = int_field(j, "index_head_dim", origin);
  c.index_topk = int_field(j, "index_topk", origin);
  c.rope_theta = number_field(j, "rope_theta", origin);
  c.compress_rope_theta = number_field(j, "compress_rope_theta", origin);
  c.rms_norm_eps = number_field_or(j, "rms_norm_eps", 1e-6, origin);
  c.max_position_embeddings = int_field<int64_t>(j, "max_position_embeddings", origin);
  const int kv_heads = int_field_or(j, "num_key_value_heads", 1, origin);
  DSV4_REQUIRE(kv_heads == 1, origin + ": num_key_value_heads must be 1 (one shared KV head), got " +
                             std::to_string(kv_heads));

  const nlohmann::json& rs = object_field(j, "rope_scaling", origin);
  const std::string rs_origin = origin + ": rope_scaling";
  const std::string type =
      string_field_or(rs, "type", string_field_or(rs, "rope_type", "yarn", rs_origin), rs_origin);
  DSV4_REQUIRE(type == "yarn", rs_origin + ": type must be 'yarn' (got '" + type + "')");
  c.yarn.factor = number_field(rs, "factor", rs_origin);
  c.yarn.original_max_position = int_field<int64_t>(rs, "original_max_position_embeddings", rs_origin);
  c.yarn.beta_fast = number_field_or(rs, "beta_fast", 32, rs_origin);
  c.yarn.beta_slow = number_field_or(rs, "beta_slow", 1, rs_origin);

  std::vector<int> ratios;
  if (j.contains("compress_ratios")) ratios = int_list_field(j, "compress_ratios", origin);
  else if (j.contains("layer_types")) ratios = ratios_from_layer_types(j, origin);
  else throw Error(origin + ": missing field 'compress_ratios' (or 'layer_types')");
  // Flash/Pro list one more entry than there are layers: the MTP block's.
  // (A layer count out of range is reported by validate() below.)
  if (c.num_layers > 0 && c.num_layers <= kMaxLayers) {
    DSV4_REQUIRE(ratios.size() >= size_t(c.num_layers), origin + ": compress_ratios has " + std::to_string(ratios.size()) +
                                                       " entries for " + std::to_string(c.num_layers) + " layers");
    ratios.resize(size_t(c.num_layers));
  }
  c.compress_ratios = ratios;

  if (const nlohmann::json* q = find_field(j, "quantization_config")) {
    const std::string q_origin = origin + ": quantization_config";
    if (!q->is_object()) wrong_type(*q, field_name(origin, "quantization_config"), "an object");
    const std::string method = string_field_or(*q, "quant_method", "fp8", q_origin);
    DSV4_REQUIRE(method == "fp8", q_origin + ": quant_method must be 'fp8' (got '" + method + "')");
    const std::vector<int> block =
        find_field(*q, "weight_block_size") ? int_list_field(*q, "weight_block_size", q_origin) : std::vector<int>{128, 128};
    DSV4_REQUIRE(block == std::vector<int>({128, 128}), q_origin + ": weight_block_size must be [128, 128]");
    c.fp8_weights = true;
  }
  c.validate();
  return c;
}

nlohmann::json read_json_file(const std::filesystem::path& path) {
  return parse_json_text(read_file_text(path), path.string());
}

ModelConfig load_config(const std::filesystem::path& path) { return config_from_json(read_json_file(path), path.string()); }

}  // namespace dsv4
