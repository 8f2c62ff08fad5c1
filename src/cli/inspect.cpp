// dsv4 inspect [PATH]: the layer schedule, the attention tensors per layer
// type, and the cache bytes per token (SPEC §2, §3, §6).
#include <cstdio>
#include <filesystem>
#include <memory>
#include <map>
#include <optional>
#include <string>

#include <nlohmann/json.hpp>

#include "cache/footprint.h"
#include "cli/commands.h"
#include "common/error.h"
#include "model/config_json.h"
#include "model/files.h"
#include "model/safetensors.h"
#include "model/weights.h"

namespace dsv4::cli {
namespace {

namespace fs = std::filesystem;

std::string shape_str(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

// A golden case ships its config inside "<case>.json" beside "<case>.weights.safetensors".
std::optional<ModelConfig> golden_case_config(const fs::path& file) {
  const std::string name = file.filename().string();
  const std::string suffix = ".weights.safetensors";
  if (name.size() <= suffix.size() || name.compare(name.size() - suffix.size(), suffix.size(), suffix) != 0)
    return std::nullopt;
  const fs::path json = file.parent_path() / (name.substr(0, name.size() - suffix.size()) + ".json");
  if (!fs::exists(json)) return std::nullopt;
  const nlohmann::json j = read_json_file(json);
  DSV4_REQUIRE(j.contains("config"), json.string() + ": missing field 'config'");
  return config_from_json(j.at("config"), json.string());
}

// The config that goes with PATH: config.json itself, the one beside a
// checkpoint, or a golden case's.
std::optional<ModelConfig> config_for(const fs::path& path) {
  if (fs::is_regular_file(path) && path.extension() == ".json") return load_config(path);
  const fs::path dir = fs::is_directory(path) ? path : path.parent_path();
  if (fs::exists(dir / "config.json")) return load_config(dir / "config.json");
  if (fs::is_regular_file(path)) return golden_case_config(path);
  return std::nullopt;
}

void print_schedule(const ModelConfig& c) {
  std::printf("layers: %d  (swaonly %d, c4a %d, c128a %d)\n", c.num_layers, c.count_layers(LayerType::kSwaOnly),
              c.count_layers(LayerType::kC4A), c.count_layers(LayerType::kC128A));
  for (LayerType t : {LayerType::kSwaOnly, LayerType::kC4A, LayerType::kC128A}) {
    std::string ids;
    for (int i = 0; i < c.num_layers; ++i)
      if (c.layer_type(i) == t) ids += (ids.empty() ? "" : ",") + std::to_string(i);
    std::printf("  %-8s %s\n", std::string(layer_type_name(t)).c_str(), ids.empty() ? "-" : ids.c_str());
  }
}

const char* expected_dtype(TensorKind k) {
  switch (k) {
    case TensorKind::kFp8Matrix: return "F8_E4M3 (+ .scale F8_E8M0)";
    case TensorKind::kDenseMatrix: return "BF16";
    case TensorKind::kVector: return "BF16";
    case TensorKind::kF32: return "F32";
  }
  return "?";
}

// Tensors of the first layer of each type: expected ones (no checkpoint) or found ones.
void print_tensors(const ModelConfig& c, const Checkpoint* ckpt) {
  for (LayerType t : {LayerType::kSwaOnly, LayerType::kC4A, LayerType::kC128A}) {
    int layer = -1;
    for (int i = 0; i < c.num_layers && layer < 0; ++i)
      if (c.layer_type(i) == t) layer = i;
    if (layer < 0) continue;
    std::printf("\n%s layers, tensors of layer %d (%s):\n", std::string(layer_type_name(t)).c_str(), layer,
                ckpt ? "found in the checkpoint" : "expected; no checkpoint given");
    const std::string prefix = layer_prefix(layer);
    if (!ckpt) {
      for (const TensorSpec& s : attention_tensor_specs(c, layer))
        std::printf("  %-42s %-16s %s\n", s.name.substr(prefix.size()).c_str(), shape_str(s.shape).c_str(),
                    expected_dtype(s.kind));
      continue;
    }
    for (const TensorView* v : ckpt->tensors())
      if (v->name.rfind(prefix, 0) == 0)
        std::printf("  %-42s %-16s %s\n", v->name.substr(prefix.size()).c_str(), shape_str(v->shape).c_str(),
                    std::string(dtype_name(v->dtype)).c_str());
  }
}

void print_cache(const ModelConfig& c) {
  const double gib = 1024.0 * 1024 * 1024, tokens_1m = 1 << 20;
  std::printf("\ncache per token of context (SPEC §6; fp8_ds_mla records, indexer keys MXFP4 | FP8):\n");
  std::printf("  %-8s %6s %22s %22s %18s\n", "type", "layers", "B/token/layer", "B/token all layers", "1M tokens (GiB)");
  for (LayerType t : {LayerType::kSwaOnly, LayerType::kC4A, LayerType::kC128A}) {
    const int n = c.count_layers(t);
    const CacheFootprint f4 = layer_footprint(t, IndexKeyFormat::kMxfp4), f8 = layer_footprint(t, IndexKeyFormat::kFp8);
    std::printf("  %-8s %6d %10.2f | %9.2f %10.1f | %9.1f %8.3f | %7.3f\n", std::string(layer_type_name(t)).c_str(), n,
                f4.bytes_per_token, f8.bytes_per_token, n * f4.bytes_per_token, n * f8.bytes_per_token,
                n * f4.bytes_per_token * tokens_1m / gib, n * f8.bytes_per_token * tokens_1m / gib);
  }
  const CacheFootprint s4 = stack_footprint(c, IndexKeyFormat::kMxfp4), s8 = stack_footprint(c, IndexKeyFormat::kFp8);
  std::printf("  %-8s %6d %22s %10.1f | %9.1f %8.3f | %7.3f\n", "total", c.num_layers, "", s4.bytes_per_token,
              s8.bytes_per_token, s4.bytes_per_token * tokens_1m / gib, s8.bytes_per_token * tokens_1m / gib);
  std::printf("  total = %.2f KB/token with MXFP4 indexer keys, %.2f KB/token with FP8 keys\n",
              s4.bytes_per_token / 1000, s8.bytes_per_token / 1000);
  std::printf("  with page padding: %.1f | %.1f B/token; fixed per request (SWA window + compressor state): %.2f MiB\n",
              s4.paged_bytes_per_token, s8.paged_bytes_per_token, s4.fixed_bytes / (1024.0 * 1024));
  const double dense = dense_mla_bytes_per_token(c);
  std::printf("  dense MLA at the same width (%d layers x %d B): %.1f B/token = %.2f KB, %.2f GiB at 1M tokens (%.1fx)\n",
              c.num_layers, 584, dense, dense / 1000, dense * tokens_1m / gib, dense / s4.bytes_per_token);
}

// Loads every layer through the validating loader (the first failure throws)
// and returns the tensors that hold NaN or Inf.
std::vector<NonFiniteTensor> print_validation(const ModelConfig& c, const Checkpoint& ckpt) {
  std::vector<NonFiniteTensor> bad;
  for (int i = 0; i < c.num_layers; ++i) {
    const std::vector<NonFiniteTensor> b = find_nonfinite(load_layer_weights(ckpt, c, i));
    bad.insert(bad.end(), b.begin(), b.end());
  }
  std::printf("\nall %d layers load and match SPEC §3 names, shapes and dtypes\n", c.num_layers);
  if (bad.empty()) {
    std::printf("every value of every layer's tensors is finite\n");
    return bad;
  }
  std::printf("tensors holding NaN or Inf:\n");
  for (const NonFiniteTensor& t : bad)
    std::printf("  %-48s %lld of %lld values (first at index %lld: %g)\n", t.name.c_str(), (long long)t.count,
                (long long)t.numel, (long long)t.first_index, double(t.first_value));
  return bad;
}

void run_inspect(const std::string& path_arg) {
  if (path_arg.empty()) {
    const ModelConfig c = preset_config("flash");
    std::printf("config: built-in preset 'flash' (DeepSeek-V4-Flash)\n");
    print_schedule(c);
    print_tensors(c, nullptr);
    print_cache(c);
    return;
  }
  const fs::path path(path_arg);
  std::error_code ec;
  DSV4_REQUIRE(fs::exists(path, ec), "no such file or directory: '" + path_arg + "'");
  if (!fs::is_directory(path, ec)) {
    const std::string problem = file_problem(path);  // a FIFO would block the reads below
    DSV4_REQUIRE(problem.empty(), "'" + path_arg + "' " + problem);
  }
  if (path.extension() != ".json") {
    DSV4_REQUIRE(fs::is_directory(path) || path.extension() == ".safetensors",
            "'" + path_arg + "' is neither a checkpoint directory, a .safetensors file nor a config.json");
  }
  const std::optional<ModelConfig> config = config_for(path);
  DSV4_REQUIRE(config.has_value(), "no config found for '" + path_arg +
                                  "' (expected config.json beside the checkpoint, or a golden case's <case>.json)");
  std::printf("config: %s\n", config->name.c_str());
  print_schedule(*config);
  if (path.extension() == ".json") {
    print_tensors(*config, nullptr);
    print_cache(*config);
    return;
  }
  const Checkpoint ckpt = Checkpoint::open(path);
  std::printf("checkpoint: %s (%zu file%s, %zu tensors)\n", path_arg.c_str(), ckpt.files().size(),
              ckpt.files().size() == 1 ? "" : "s", ckpt.tensors().size());
  print_tensors(*config, &ckpt);
  const std::vector<NonFiniteTensor> bad = print_validation(*config, ckpt);
  print_cache(*config);
  DSV4_REQUIRE(bad.empty(), std::to_string(bad.size()) + " tensor" + (bad.size() == 1 ? " holds" : "s hold") +
                           " NaN or Inf values (listed above)");
}

}  // namespace

void register_inspect(CLI::App& app) {
  auto* cmd = app.add_subcommand("inspect", "Layer schedule, attention tensors and cache bytes of a config or checkpoint");
  auto path = std::make_shared<std::string>();
  cmd->add_option("path", *path, "checkpoint directory, .safetensors file or config.json (default: built-in Flash)");
  cmd->callback([path] { run_inspect(*path); });
}

}  // namespace dsv4::cli
