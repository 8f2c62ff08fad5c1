// config.json in both spellings (SPEC §2), presets, and validation errors that
// name the field.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "model/config_json.h"

using namespace dsv4;
using nlohmann::json;

namespace {

json flash_json() {
  json j = {{"hidden_size", 4096}, {"num_hidden_layers", 43}, {"num_attention_heads", 64},
            {"num_key_value_heads", 1}, {"head_dim", 512}, {"qk_rope_head_dim", 64},
            {"q_lora_rank", 1024}, {"o_groups", 8}, {"o_lora_rank", 1024}, {"sliding_window", 128},
            {"index_n_heads", 64}, {"index_head_dim", 128}, {"index_topk", 512}, {"rope_theta", 10000},
            {"compress_rope_theta", 160000}, {"rms_norm_eps", 1e-6}, {"max_position_embeddings", 1048576},
            {"rope_scaling", {{"type", "yarn"}, {"factor", 16}, {"original_max_position_embeddings", 65536},
                              {"beta_fast", 32}, {"beta_slow", 1}}},
            {"quantization_config", {{"quant_method", "fp8"}, {"fmt", "e4m3"}, {"scale_fmt", "ue8m0"},
                                     {"weight_block_size", {128, 128}}}}};
  std::vector<int> ratios = {0, 0};
  for (int i = 0; i < 20; ++i) ratios.insert(ratios.end(), {4, 128});
  ratios.insert(ratios.end(), {4, 0});  // layer 42, then the MTP block's entry
  j["compress_ratios"] = ratios;
  return j;
}

// The Error message of parsing j, or "" if it parsed.
std::string error_of(const json& j) {
  try {
    config_from_json(j, "config.json");
  } catch (const std::runtime_error& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST(Config, FlashFromCompressRatiosMatchesThePreset) {
  const ModelConfig c = config_from_json(flash_json(), "config.json");
  const ModelConfig p = preset_config("flash");
  EXPECT_EQ(c.compress_ratios, p.compress_ratios);
  EXPECT_EQ(c.num_layers, 43);
  EXPECT_EQ(c.count_layers(LayerType::kSwaOnly), 2);
  EXPECT_EQ(c.count_layers(LayerType::kC4A), 21);
  EXPECT_EQ(c.count_layers(LayerType::kC128A), 20);
  EXPECT_TRUE(c.fp8_weights);
  EXPECT_EQ(c.yarn.original_max_position, 65536);
}

TEST(Config, LayerTypesSpellingGivesTheSameSchedule) {
  json j = flash_json();
  std::vector<std::string> types;
  for (int r : j["compress_ratios"].get<std::vector<int>>())
    types.push_back(r == 0 ? "sliding_attention" : r == 4 ? "compressed_sparse_attention" : "heavily_compressed_attention");
  j.erase("compress_ratios");
  j["layer_types"] = types;
  j["compress_rates"] = {{"compressed_sparse_attention", 4}, {"heavily_compressed_attention", 128}};
  EXPECT_EQ(config_from_json(j, "config.json").compress_ratios, preset_config("flash").compress_ratios);
  j["layer_types"][5] = "global_attention";
  EXPECT_NE(error_of(j).find("layer_types[5]: unknown layer type 'global_attention'"), std::string::npos)
      << error_of(j);
}

TEST(Config, ProPreset) {
  const ModelConfig p = preset_config("pro");
  EXPECT_EQ(p.count_layers(LayerType::kSwaOnly), 0);
  EXPECT_EQ(p.count_layers(LayerType::kC4A), 30);
  EXPECT_EQ(p.count_layers(LayerType::kC128A), 31);
  EXPECT_THROW(preset_config("ultra"), std::runtime_error);
}

TEST(Config, ErrorsNameTheField) {
  struct Case {
    const char* field;
    json value;
    const char* expect;
  };
  const Case cases[] = {
      {"head_dim", 256, "head_dim must be 512"},
      {"qk_rope_head_dim", 32, "qk_rope_head_dim must be 64"},
      {"sliding_window", 64, "sliding_window must be 128"},
      {"o_groups", 7, "not divisible by o_groups"},
      {"num_key_value_heads", 8, "num_key_value_heads must be 1"},
      {"index_head_dim", 64, "index_head_dim must be 128"},
      {"hidden_size", "4096", "field 'hidden_size' has the wrong type"},
      {"hidden_size", -1, "hidden_size must be positive"},
  };
  for (const Case& c : cases) {
    json j = flash_json();
    j[c.field] = c.value;
    EXPECT_NE(error_of(j).find(c.expect), std::string::npos) << c.field << ": " << error_of(j);
  }
  json j = flash_json();
  j["compress_ratios"][7] = 16;
  EXPECT_NE(error_of(j).find("compress_ratios[7]: unknown compress ratio 16"), std::string::npos) << error_of(j);
  for (const char* field : {"q_lora_rank", "rope_scaling", "index_topk", "max_position_embeddings"}) {
    json k = flash_json();
    k.erase(field);
    EXPECT_NE(error_of(k).find(std::string("missing field '") + field + "'"), std::string::npos) << error_of(k);
  }
  json short_ratios = flash_json();
  short_ratios["compress_ratios"] = std::vector<int>(10, 4);
  EXPECT_NE(error_of(short_ratios).find("10 entries for 43 layers"), std::string::npos);
  json no_schedule = flash_json();
  no_schedule.erase("compress_ratios");
  EXPECT_NE(error_of(no_schedule).find("missing field 'compress_ratios'"), std::string::npos);
}

TEST(Config, LoadConfigReportsBadFiles) {
  EXPECT_THROW(load_config("/no/such/config.json"), std::runtime_error);
}
