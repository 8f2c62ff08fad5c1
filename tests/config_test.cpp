// config.json in both spellings (SPEC §2), presets, and validation errors that
// name the field.
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <fstream>
#include <limits>

#include <nlohmann/json.hpp>

#include "model/config_json.h"
#include "support/temp_dir.h"

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

// ---- exact integers, finite numbers, bounds ---------------------------------------------

TEST(Config, IntegersAreExactAndInRange) {
  struct Case {
    const char* field;
    json value;
    const char* expect;
  };
  const Case cases[] = {
      {"hidden_size", 4294967552ull, "field 'hidden_size' = 4294967552 is out of range [-2147483648, 2147483647]"},
      {"hidden_size", 256.7, "field 'hidden_size' must be an exact integer (got 256.7)"},
      {"hidden_size", 4096.0, "field 'hidden_size' must be an exact integer"},
      {"hidden_size", true, "field 'hidden_size' has the wrong type: expected an integer, got boolean true"},
      {"num_hidden_layers", -3, "num_hidden_layers must be positive (got -3)"},
      {"num_hidden_layers", 18446744073709551615ull, "field 'num_hidden_layers' = 18446744073709551615 is out of range"},
      {"index_topk", -9223372036854775807ll, "field 'index_topk' = -9223372036854775807 is out of range"},
      {"q_lora_rank", json::array({1024}), "field 'q_lora_rank' has the wrong type: expected an integer, got array"},
      {"num_key_value_heads", 1.5, "field 'num_key_value_heads' must be an exact integer"},
      {"max_position_embeddings", 4294967552ull, "max_position_embeddings must be at most 2147483647 (got 4294967552)"},
      {"max_position_embeddings", 0, "max_position_embeddings must be positive"},
      {"rope_theta", true, "field 'rope_theta' has the wrong type: expected a number, got boolean"},
      {"rope_theta", "1e4", "field 'rope_theta' has the wrong type: expected a number, got string"},
      {"rms_norm_eps", -1e-6, "rms_norm_eps must be positive"},
      {"rope_scaling", 5, "field 'rope_scaling' has the wrong type: expected an object, got number 5"},
      {"quantization_config", "fp8", "field 'quantization_config' has the wrong type: expected an object"},
      {"compress_ratios", 4, "field 'compress_ratios' has the wrong type: expected an array"},
  };
  for (const Case& c : cases) {
    json j = flash_json();
    j[c.field] = c.value;
    EXPECT_NE(error_of(j).find(c.expect), std::string::npos) << c.field << " = " << c.value.dump() << ": " << error_of(j);
  }
  json j = flash_json();
  j["compress_ratios"][3] = 4.5;
  EXPECT_NE(error_of(j).find("field 'compress_ratios[3]' must be an exact integer (got 4.5)"), std::string::npos)
      << error_of(j);
  j = flash_json();
  j["compress_ratios"][3] = true;
  EXPECT_NE(error_of(j).find("field 'compress_ratios[3]' has the wrong type"), std::string::npos) << error_of(j);
  j = flash_json();
  j["rope_scaling"]["original_max_position_embeddings"] = 65536.5;
  EXPECT_NE(error_of(j).find("rope_scaling: field 'original_max_position_embeddings' must be an exact integer"),
            std::string::npos)
      << error_of(j);
  j = flash_json();
  j["rope_scaling"]["factor"] = false;
  EXPECT_NE(error_of(j).find("rope_scaling: field 'factor' has the wrong type"), std::string::npos) << error_of(j);
  j = flash_json();
  j["quantization_config"]["weight_block_size"] = {128, 128.5};
  EXPECT_NE(error_of(j).find("field 'weight_block_size[1]' must be an exact integer"), std::string::npos)
      << error_of(j);
  j = flash_json();
  std::vector<std::string> types(43, "sliding_attention");
  j.erase("compress_ratios");
  j["layer_types"] = types;
  j["layer_types"][2] = 4;
  EXPECT_NE(error_of(j).find("field 'layer_types[2]' has the wrong type: expected a string"), std::string::npos)
      << error_of(j);
  j["layer_types"][2] = "sliding_attention";
  j["compress_rates"] = {{"compressed_sparse_attention", 4.0}};
  j["layer_types"][3] = "compressed_sparse_attention";
  EXPECT_NE(error_of(j).find("compress_rates: field 'compressed_sparse_attention' must be an exact integer"),
            std::string::npos)
      << error_of(j);
  EXPECT_NE(error_of(json::array()).find("expected a JSON object (got array)"), std::string::npos);
}

TEST(Config, BoundsLeaveNoRoomForOverflow) {
  // Each field at the bound passes its own check; products are formed in 64 bits.
  struct Case {
    const char* field;
    json value;
    const char* expect;
  };
  const Case cases[] = {
      {"hidden_size", 2147483647, "hidden_size must be at most 1048576 (got 2147483647)"},
      {"num_attention_heads", 2147483647, "num_attention_heads must be at most 4096"},
      {"num_hidden_layers", 100000, "num_hidden_layers must be at most 4096"},
      {"index_topk", 2147483647, "index_topk must be at most 1048576"},
      {"o_lora_rank", 2147483647, "o_lora_rank must be at most 1048576"},
  };
  for (const Case& c : cases) {
    json j = flash_json();
    j[c.field] = c.value;
    EXPECT_NE(error_of(j).find(c.expect), std::string::npos) << c.field << ": " << error_of(j);
  }
  // 64 groups of 1M: each in range, the product (2^26) is not, and does not wrap.
  json j = flash_json();
  j["num_attention_heads"] = 64;
  j["o_groups"] = 64;
  j["o_lora_rank"] = 1048576;
  EXPECT_NE(error_of(j).find("o_groups * o_lora_rank = 67108864 must be at most 1048576"), std::string::npos)
      << error_of(j);
  // A hand-built config gets the same checks.
  ModelConfig c = preset_config("mini");
  c.o_groups = 4096, c.num_heads = 4096, c.o_lora_rank = 1 << 20;
  EXPECT_THROW(c.validate(), std::runtime_error);
  c = preset_config("mini");
  c.rope_theta = std::numeric_limits<double>::infinity();
  EXPECT_THROW(c.validate(), std::runtime_error);
  c = preset_config("mini");
  c.rms_norm_eps = std::numeric_limits<double>::quiet_NaN();
  EXPECT_THROW(c.validate(), std::runtime_error);
}

// The reference accepts any width; only the production profile's FP8 blocks need 128.
json odd_json() {
  json j = flash_json();
  j["hidden_size"] = 320;
  j["q_lora_rank"] = 160;
  j["o_groups"] = 8;
  j["o_lora_rank"] = 20;  // o_groups * o_lora_rank = 160
  return j;
}

TEST(Config, ExactProfileAcceptsAnyWidth) {
  const ModelConfig c = config_from_json(odd_json(), "odd.json");
  EXPECT_EQ(c.hidden_size, 320);
  EXPECT_EQ(c.q_lora_rank, 160);
  EXPECT_EQ(c.o_groups * c.o_lora_rank, 160);
}

TEST(Config, ProductionDimsNameFieldValueAndProfile) {
  auto production_error = [](const json& j) {
    try {
      check_production_dims(config_from_json(j, "odd.json"));
    } catch (const std::runtime_error& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  json j = odd_json();
  std::string e = production_error(j);
  EXPECT_NE(e.find("odd.json: hidden_size = 320 is not a multiple of 128"), std::string::npos) << e;
  EXPECT_NE(e.find("production profile"), std::string::npos) << e;
  j["hidden_size"] = 384;
  e = production_error(j);
  EXPECT_NE(e.find("q_lora_rank = 160 is not a multiple of 128"), std::string::npos) << e;
  EXPECT_NE(e.find("production profile"), std::string::npos) << e;
  j["q_lora_rank"] = 256;
  e = production_error(j);
  EXPECT_NE(e.find("o_groups * o_lora_rank (8 * 20) = 160 is not a multiple of 128"), std::string::npos) << e;
  j["o_lora_rank"] = 16;  // 8 * 16 = 128: o_lora_rank alone need not be a multiple
  EXPECT_EQ(production_error(j), "");
  for (const char* p : {"flash", "pro", "mini", "small"}) EXPECT_NO_THROW(check_production_dims(preset_config(p))) << p;
}

// ---- files ----------------------------------------------------------------------------------

TEST(Config, FilesThatAreNotJsonOrNotFiles) {
  dsv4::test::TempDir dir;
  auto load_error = [](const std::filesystem::path& p) {
    try {
      load_config(p);
    } catch (const std::runtime_error& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  // A number too large for a double: an error naming the field, not a raw exception.
  std::string text = flash_json().dump();
  const std::string key = "\"hidden_size\":4096";
  ASSERT_NE(text.find(key), std::string::npos);
  std::ofstream(dir / "big.json") << std::string(text).replace(text.find(key), key.size(), "\"hidden_size\":1e999");
  std::string e = load_error(dir / "big.json");
  EXPECT_NE(e.find("at 'hidden_size'"), std::string::npos) << e;
  EXPECT_NE(e.find("number overflow"), std::string::npos) << e;
  // A repeated key is refused rather than the last one silently kept.
  std::ofstream(dir / "twice.json") << "{\"hidden_size\": 4096, " + text.substr(1);
  e = load_error(dir / "twice.json");
  EXPECT_NE(e.find("key 'hidden_size' appears twice in the top-level object"), std::string::npos) << e;
  std::ofstream(dir / "broken.json") << text.substr(0, text.size() / 2);
  EXPECT_NE(load_error(dir / "broken.json").find("invalid JSON"), std::string::npos);
  std::filesystem::create_directory(dir / "dir.json");
  e = load_error(dir / "dir.json");
  EXPECT_NE(e.find("dir.json: is a directory"), std::string::npos) << e;
  ASSERT_EQ(mkfifo((dir / "fifo.json").c_str(), 0600), 0);
  e = load_error(dir / "fifo.json");  // must not block waiting for a writer
  EXPECT_NE(e.find("fifo.json: is a FIFO"), std::string::npos) << e;
  EXPECT_NE(load_error(dir / "none.json").find("none.json: cannot open: No such file or directory"), std::string::npos);
}
