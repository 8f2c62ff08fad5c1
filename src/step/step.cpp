#include "step/step.h"

#include <algorithm>
#include <set>

#include "common/error.h"

namespace dsv4 {
namespace {

// Throws Error when a run cannot be part of this step.
void check_run(const Run& run, const ModelConfig& config, const BlockManager& blocks, const std::set<int64_t>& seen) {
  const std::string who = "request " + std::to_string(run.request);
  if (!blocks.has_request(run.request)) throw Error("unknown request " + std::to_string(run.request));
  if (seen.count(run.request)) throw Error(who + ": more than one run in the same step");
  if (run.len <= 0) throw Error(who + ": zero-length run");
  const int64_t have = blocks.length(run.request);
  if (run.start_pos != have)
    throw Error(who + ": run starts at position " + std::to_string(run.start_pos) + " but the request holds " +
                std::to_string(have) + " tokens");
  if (run.start_pos + run.len > config.max_position_embeddings)
    throw Error(who + ": positions up to " + std::to_string(run.start_pos + run.len - 1) +
                " exceed max_position_embeddings (" + std::to_string(config.max_position_embeddings) + ")");
}

}  // namespace

StepView StepMetadata::view() const {
  DSV4_REQUIRE(has_lists(), "step: built without its derived lists (for a backend that derives them itself)");
  return step_view(const_cast<int32_t*>(buffer_.data()), dims_);
}

void StepMetadata::build(const BlockManager& blocks, bool lists) {
  const CacheSpec& spec = blocks.spec();
  dims_ = StepDims{};
  dims_.runs = int32_t(runs.size());
  int64_t tokens = 0, widest_c128a = 0;
  for (const Run& r : runs) {
    tokens += r.len;
    widest_c128a = std::max(widest_c128a, (r.start_pos + r.len) / 128);
    for (CacheGroup g : kAllCacheGroups) {
      if (!blocks.uses(g)) continue;
      const BlockRange b = spec.blocks_touched(g, r.start_pos, r.len);
      const int64_t w = b.empty() ? 0 : b.last - b.first + 1;
      dims_.table_width[int(g)] = int32_t(std::max<int64_t>(dims_.table_width[int(g)], w));
    }
  }
  DSV4_REQUIRE(tokens <= INT32_MAX, "step: too many tokens");
  dims_.tokens = int32_t(tokens);
  dims_.c128a_width = blocks.uses(CacheGroup::kC128A) ? int32_t((widest_c128a + 63) / 64 * 64) : 0;
  layout_ = step_layout(dims_);
  buffer_.assign(size_t(lists ? layout_.total : layout_.inputs_end), -1);
  write_step_header(buffer_.data(), dims_);
  int32_t* b = buffer_.data();
  int t = 0;
  for (int r = 0; r < dims_.runs; ++r) {
    const Run& run = runs[size_t(r)];
    b[layout_.run_start + r] = int32_t(run.start_pos);
    b[layout_.run_len + r] = run.len;
    b[layout_.run_token_begin + r] = t;
    for (int k = 0; k < run.len; ++k, ++t) {
      b[layout_.positions + t] = int32_t(run.start_pos + k);
      b[layout_.token_run + t] = r;
    }
    // The rows of the run's tables: the blocks the run touches, copied from
    // the request's table where it covers them (the rest stays -1).
    for (CacheGroup g : kAllCacheGroups) {
      const int w = dims_.table_width[int(g)];
      if (w == 0) continue;
      const BlockRange want = spec.blocks_touched(g, run.start_pos, run.len);
      const BlockTableRef have = blocks.table(g, run.request);
      b[layout_.table_first[int(g)] + r] = int32_t(want.empty() ? 0 : want.first);
      const int64_t lo = std::max(want.first, have.first);
      const int64_t hi = std::min(want.last + 1, have.first + int64_t(have.pages.size()));
      if (lo < hi)
        std::copy_n(have.pages.data() + (lo - have.first), hi - lo,
                    b + layout_.table_pages[int(g)] + int64_t(r) * w + (lo - want.first));
    }
  }
  b[layout_.run_token_begin + dims_.runs] = t;
  if (!lists) return;  // at 128 decode runs of 64K context the lists were 60% of the plan
  const StepView v = view();
  for (int k = 0; k < dims_.tokens; ++k) derive_token(v, k);
}

StepMetadata plan_step(const std::vector<Run>& runs, const ModelConfig& config, BlockManager& blocks,
                       std::vector<RunError>& errors, bool lists) {
  StepMetadata s;
  std::set<int64_t> seen;
  int64_t tokens = 0;
  for (size_t i = 0; i < runs.size(); ++i) {
    const Run& run = runs[i];
    try {
      check_run(run, config, blocks, seen);
      if (tokens + run.len > INT32_MAX) throw Error("request " + std::to_string(run.request) + ": the step holds too many tokens");
      blocks.reserve(run.request, run.start_pos, run.len);
    } catch (const CacheExhausted& e) {
      errors.push_back({i, e.what(), true});
      continue;
    } catch (const Error& e) {
      errors.push_back({i, e.what()});
      continue;
    }
    seen.insert(run.request);
    tokens += run.len;
    s.runs.push_back(run);
    s.input_index.push_back(i);
  }
  s.build(blocks, lists);
  return s;
}

}  // namespace dsv4
