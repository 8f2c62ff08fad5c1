#pragma once
// A strict JSON reader for the files the project trusts least (safetensors
// headers, config.json, checkpoint indexes, golden cases): linear in the size
// of the text, it refuses what nlohmann::json::parse hides or mis-reports.
//  - A key repeated within one object (the DOM parser keeps the last).
//  - Nesting deeper than a limit (hostile input building deep trees).
//  - Errors, number overflow (1e999) included, name where they occur.
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

#include "common/error.h"

namespace dsv4 {

// Why a text was refused; what() is the whole message, prefixed with the origin.
struct JsonParseError : Error {
  enum class Kind { kSyntax, kDuplicateKey, kTooDeep };
  JsonParseError(const std::string& message, Kind kind, std::string path, std::string key, size_t depth,
                 std::string detail)
      : Error(message), kind(kind), path(std::move(path)), key(std::move(key)), depth(depth),
        detail(std::move(detail)) {}

  Kind kind;
  std::string path;    // where: "rope_scaling.factor", "requests[2].calls"; "" at the top level
  std::string key;     // kDuplicateKey: the repeated key
  size_t depth = 0;    // containers open where it happened (1: inside the top-level object)
  std::string detail;  // kSyntax: the JSON library's message
};

// Parses `text`; throws JsonParseError naming `origin` and the path of the
// problem. At most `max_depth` containers may be open at once.
nlohmann::json parse_json_text(std::string_view text, const std::string& origin, size_t max_depth = 64);

// `v` as an exact integer in [lo, hi]: a JSON integer, not 256.7, true or
// "256". Throws Error naming `what` (e.g. "config.json: field 'hidden_size'")
// and, when out of range, the bounds.
int64_t json_integer(const nlohmann::json& v, const std::string& what, int64_t lo, int64_t hi);

}  // namespace dsv4
