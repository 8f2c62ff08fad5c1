#include "runtime/step.h"

#include <algorithm>
#include <set>

#include "common/error.h"

namespace dsv4 {

int32_t StepMetadata::map_slot(const std::vector<int32_t>& table, CacheGroup g, int64_t entry) {
  const int b = group_entries_per_page(g);
  const int64_t blk = entry / b;
  require(entry >= 0 && blk < int64_t(table.size()) && table[size_t(blk)] >= 0,
          "entry " + std::to_string(entry) + " of cache '" + std::string(cache_group_name(g)) + "' has no page");
  return int32_t(int64_t(table[size_t(blk)]) * b + entry % b);
}

namespace {

// Throws Error when a run cannot be part of this step.
void check_run(const Run& run, const ModelConfig& config, const CacheManager& caches,
               const std::set<int64_t>& seen) {
  const std::string who = "request " + std::to_string(run.request);
  require(caches.has_request(run.request), "unknown request " + std::to_string(run.request));
  require(!seen.count(run.request), who + ": more than one run in the same step");
  require(run.len > 0, who + ": zero-length run");
  const int64_t have = caches.length(run.request);
  require(run.start_pos == have, who + ": run starts at position " + std::to_string(run.start_pos) +
                                     " but the request holds " + std::to_string(have) + " tokens");
  require(run.start_pos + run.len <= config.max_position_embeddings,
          who + ": positions up to " + std::to_string(run.start_pos + run.len - 1) +
              " exceed max_position_embeddings (" + std::to_string(config.max_position_embeddings) + ")");
}

// Slot of the compressed entry position `pos` completes, or -1.
int32_t completed_slot(const std::vector<int32_t>& table, CacheGroup g, int64_t pos) {
  const int m = group_tokens_per_entry(g);
  if ((pos + 1) % m != 0) return -1;
  return StepMetadata::map_slot(table, g, (pos + 1) / m - 1);
}

void build_token_maps(StepMetadata& s, const CacheManager& caches) {
  const bool c4a = caches.uses(CacheGroup::kC4A), c128a = caches.uses(CacheGroup::kC128A);
  const int T = s.num_tokens();
  s.swa_slot.assign(size_t(T), -1);
  s.c4a_slot.assign(size_t(T), -1), s.c128a_slot.assign(size_t(T), -1);
  s.c4a_state_slot.assign(size_t(T), -1), s.c128a_state_slot.assign(size_t(T), -1);
  s.window_indices.assign(size_t(T) * kWindow, -1);
  s.window_lengths.assign(size_t(T), 0);
  for (int t = 0; t < T; ++t) {
    const int r = s.token_run[size_t(t)];
    const int64_t id = s.runs[size_t(r)].request, pos = s.positions[size_t(t)];
    const auto& swa = caches.table(CacheGroup::kSwa, id);
    s.swa_slot[size_t(t)] = StepMetadata::map_slot(swa, CacheGroup::kSwa, pos);
    const int64_t first = std::max<int64_t>(0, pos - (kWindow - 1));
    s.window_lengths[size_t(t)] = int32_t(pos - first + 1);
    for (int64_t p = first; p <= pos; ++p)
      s.window_indices[size_t(t) * kWindow + size_t(p - first)] = StepMetadata::map_slot(swa, CacheGroup::kSwa, p);
    if (c4a) {
      s.c4a_slot[size_t(t)] = completed_slot(s.c4a_table[size_t(r)], CacheGroup::kC4A, pos);
      s.c4a_state_slot[size_t(t)] = StepMetadata::map_slot(s.c4a_state_table[size_t(r)], CacheGroup::kC4AState, pos);
    }
    if (c128a) {
      s.c128a_slot[size_t(t)] = completed_slot(caches.table(CacheGroup::kC128A, id), CacheGroup::kC128A, pos);
      s.c128a_state_slot[size_t(t)] =
          StepMetadata::map_slot(s.c128a_state_table[size_t(r)], CacheGroup::kC128AState, pos);
    }
  }
}

// Every visible C128A slot j < (pos + 1) / 128, as global slots.
void build_c128a_lists(StepMetadata& s, const CacheManager& caches) {
  if (!caches.uses(CacheGroup::kC128A)) return;
  const int T = s.num_tokens();
  int64_t widest = 0;
  for (int64_t pos : s.positions) widest = std::max(widest, (pos + 1) / 128);
  s.c128a_width = int((widest + 63) / 64 * 64);
  s.c128a_indices.assign(size_t(T) * size_t(s.c128a_width), -1);
  s.c128a_lengths.assign(size_t(T), 0);
  for (int t = 0; t < T; ++t) {
    const int64_t id = s.runs[size_t(s.token_run[size_t(t)])].request;
    const int64_t visible = (s.positions[size_t(t)] + 1) / 128;
    s.c128a_lengths[size_t(t)] = int32_t(visible);
    const auto& table = caches.table(CacheGroup::kC128A, id);
    for (int64_t j = 0; j < visible; ++j)
      s.c128a_indices[size_t(t) * s.c128a_width + size_t(j)] = StepMetadata::map_slot(table, CacheGroup::kC128A, j);
  }
}

}  // namespace

StepMetadata plan_step(const std::vector<Run>& runs, const ModelConfig& config, CacheManager& caches,
                       std::vector<RunError>& errors) {
  StepMetadata s;
  std::set<int64_t> seen;
  s.token_begin.push_back(0);
  for (size_t i = 0; i < runs.size(); ++i) {
    const Run& run = runs[i];
    try {
      check_run(run, config, caches, seen);
      caches.reserve(run.request, run.start_pos, run.len);
    } catch (const Error& e) {
      errors.push_back({i, e.what()});
      continue;
    }
    seen.insert(run.request);
    const int r = int(s.runs.size());
    s.runs.push_back(run);
    s.input_index.push_back(i);
    for (int k = 0; k < run.len; ++k) {
      s.positions.push_back(run.start_pos + k);
      s.token_run.push_back(r);
    }
    s.token_begin.push_back(int(s.positions.size()));
    const bool c4a = caches.uses(CacheGroup::kC4A), c128a = caches.uses(CacheGroup::kC128A);
    s.c4a_table.push_back(c4a ? caches.table(CacheGroup::kC4A, run.request) : std::vector<int32_t>{});
    s.c4a_state_table.push_back(c4a ? caches.table(CacheGroup::kC4AState, run.request) : std::vector<int32_t>{});
    s.c128a_state_table.push_back(c128a ? caches.table(CacheGroup::kC128AState, run.request)
                                        : std::vector<int32_t>{});
  }
  build_token_maps(s, caches);
  build_c128a_lists(s, caches);
  return s;
}

}  // namespace dsv4
