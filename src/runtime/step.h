#pragma once
// One step of the runtime (SPEC §7): a batch of runs (a prefill chunk or one
// decode token per request) and the metadata every layer of a type shares,
// built once per step: slot mappings, window index lists, C128A visible lists
// and the per-request tables the C4A indexer maps its local picks through.
#include <cstdint>
#include <string>
#include <vector>

#include "cache/cache_manager.h"
#include "model/config.h"

namespace dsv4 {

inline constexpr int kWindow = 128;

// `len` new tokens of request `request`, at positions start_pos .. start_pos + len - 1.
struct Run {
  int64_t request = 0;
  int64_t start_pos = 0;
  int len = 0;
};

struct RunError {
  size_t run = 0;  // index into the step's input runs
  std::string message;
};

struct StepMetadata {
  // Accepted runs (a subset of the input, in input order) and their tokens.
  std::vector<Run> runs;
  std::vector<size_t> input_index;  // per accepted run: its index in the input
  std::vector<int> token_begin;     // per accepted run: first token; size runs + 1
  std::vector<int64_t> positions;   // [T]
  std::vector<int32_t> token_run;   // [T] accepted run of each token
  int num_tokens() const { return int(positions.size()); }

  // Slot mappings, [T], -1 where a token writes nothing (SPEC §7).
  std::vector<int32_t> swa_slot;
  std::vector<int32_t> c4a_slot, c128a_slot;              // compressed entry a token completes
  std::vector<int32_t> c4a_state_slot, c128a_state_slot;  // the token's own compressor-state row

  // Window lists: global SWA slots of positions pos-127 .. pos, [T, 128], -1 padded.
  std::vector<int32_t> window_indices, window_lengths;

  // C128A: every visible compressed slot, [T, c128a_width], width a multiple of 64.
  int c128a_width = 0;
  std::vector<int32_t> c128a_indices, c128a_lengths;

  // Per accepted run, copies of the request's block tables: the C4A indexer
  // maps request-local slots through `c4a_table`, compressors find the rows of
  // earlier positions through the state tables.
  std::vector<std::vector<int32_t>> c4a_table, c4a_state_table, c128a_state_table;

  // Global slot of request-local entry `entry` through a copied table.
  static int32_t map_slot(const std::vector<int32_t>& table, CacheGroup g, int64_t entry);
};

// Validates each run against the caches (known request, contiguous positions,
// positive length, within max_position_embeddings, not twice in the step),
// reserves its pages and builds the metadata. A run that fails is left out
// with an error; the others proceed.
StepMetadata plan_step(const std::vector<Run>& runs, const ModelConfig& config, CacheManager& caches,
                       std::vector<RunError>& errors);

}  // namespace dsv4
