#pragma once
// The JSON side of model/config.h, apart so that modules which only use a
// ModelConfig (the CUDA backend among them) need no JSON library.
#include <filesystem>
#include <string>

#include <nlohmann/json_fwd.hpp>

#include "model/config.h"

namespace dsv4 {

// Parses a config.json object (either spelling of the layer schedule, SPEC §2)
// and validates it. `origin` names the source in error messages.
ModelConfig config_from_json(const nlohmann::json& j, const std::string& origin);

// Reads and parses a JSON file; throws Error naming the file when it cannot.
nlohmann::json read_json_file(const std::filesystem::path& path);

}  // namespace dsv4
