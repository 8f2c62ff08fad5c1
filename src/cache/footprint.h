#pragma once
// Cache bytes per token of context (SPEC §6), per layer type and per stack.
#include "cache/index_key_format.h"
#include "model/config.h"

namespace dsv4 {

struct CacheFootprint {
  double bytes_per_token = 0;        // growing part, exact record sizes
  double paged_bytes_per_token = 0;  // growing part, with page padding
  double fixed_bytes = 0;            // per request, independent of length: SWA window + compressor state
};

// One layer of type t.
CacheFootprint layer_footprint(LayerType t, IndexKeyFormat keys);
// All layers of a config.
CacheFootprint stack_footprint(const ModelConfig& config, IndexKeyFormat keys);
// Dense MLA at the same width: every layer keeps a 584-byte record per token.
double dense_mla_bytes_per_token(const ModelConfig& config);

}  // namespace dsv4
