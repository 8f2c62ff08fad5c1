// Step metadata (SPEC §7) against positions computed by hand, the flat
// layout's round trip, and the rejection of bad runs while the rest of the
// step proceeds.
#include <gtest/gtest.h>

#include "common/error.h"
#include "step/step.h"

#include <algorithm>

using namespace dsv4;

namespace {

struct Caches {
  ModelConfig config = preset_config("mini");
  CacheSpec spec{config, CacheFormats{}};
  BlockManager blocks;
  explicit Caches(int requests = 4, int64_t context = 4096, int64_t step = 2048)
      : blocks(spec, CacheLimits::for_workload(spec, requests, context, step)) {}
};

// Checks every per-token field of s against the definitions.
void check_metadata(const StepMetadata& s, const BlockManager& bm) {
  const StepView v = s.view();
  for (int t = 0; t < s.num_tokens(); ++t) {
    const int64_t id = s.runs[size_t(v.token_run[t])].request, pos = v.positions[t];
    EXPECT_EQ(v.swa_slot[t], bm.slot(CacheGroup::kSwa, id, pos));
    const int len = int(std::min<int64_t>(pos + 1, 128));
    ASSERT_EQ(v.window_lengths[t], len);
    for (int i = 0; i < 128; ++i) {
      const int32_t want = i < len ? bm.slot(CacheGroup::kSwa, id, pos - len + 1 + i) : -1;
      ASSERT_EQ(v.window_indices[size_t(t) * 128 + i], want) << "token " << t << " entry " << i;
    }
    EXPECT_EQ(v.c4a_slot[t], (pos + 1) % 4 == 0 ? bm.slot(CacheGroup::kC4A, id, (pos + 1) / 4 - 1) : -1);
    EXPECT_EQ(v.c128a_slot[t], (pos + 1) % 128 == 0 ? bm.slot(CacheGroup::kC128A, id, (pos + 1) / 128 - 1) : -1);
    // State rows: none in a block that the run's own tokens fill and no
    // later token reads (its entries pool those rows from the projection).
    const dsv4::Run& run = s.runs[size_t(v.token_run[t])];
    for (CacheGroup g : {CacheGroup::kC4AState, CacheGroup::kC128AState}) {
      const int32_t got = g == CacheGroup::kC4AState ? v.c4a_state_slot[t] : v.c128a_state_slot[t];
      const int64_t block = pos / group_entries_per_page(g);
      EXPECT_EQ(got, bm.spec().needs_page(g, block, run.start_pos, run.len) ? bm.slot(g, id, pos) : -1)
          << cache_group_name(g) << " row of token " << t;
    }
    const int visible = int((pos + 1) / 128);
    ASSERT_EQ(v.c128a_lengths[t], visible);
    EXPECT_EQ(s.dims().c128a_width % 64, 0);
    for (int j = 0; j < s.dims().c128a_width; ++j)
      ASSERT_EQ(v.c128a_indices[size_t(t) * s.dims().c128a_width + j],
                j < visible ? bm.slot(CacheGroup::kC128A, id, j) : -1);
  }
}

}  // namespace

TEST(StepMetadata, MixedPrefillAndDecodeMatchPositions) {
  Caches c;
  std::vector<RunError> errors;
  c.blocks.open_request(10), c.blocks.open_request(11), c.blocks.open_request(12);
  // Step 1: prefills of different lengths, one ending mid-block.
  auto s1 = plan_step({{10, 0, 300}, {11, 0, 3}, {12, 0, 131}}, c.config, c.blocks, errors);
  ASSERT_TRUE(errors.empty());
  EXPECT_EQ(s1.num_tokens(), 434);
  check_metadata(s1, c.blocks);
  for (const dsv4::Run& r : s1.runs) c.blocks.commit(r.request, r.start_pos + r.len);
  // Step 2: a decode token, a chunk crossing a block boundary, another decode.
  auto s2 = plan_step({{10, 300, 1}, {11, 3, 254}, {12, 131, 1}}, c.config, c.blocks, errors);
  ASSERT_TRUE(errors.empty());
  check_metadata(s2, c.blocks);
  EXPECT_EQ(s2.token_begin(0), 0);
  EXPECT_EQ(s2.token_begin(1), 1);
  EXPECT_EQ(s2.token_begin(2), 255);
  EXPECT_EQ(s2.token_begin(3), 256);
  EXPECT_EQ(s2.view().c128a_lengths[0], 2);  // position 300 sees slots 0, 1
  EXPECT_EQ(s2.dims().c128a_width, 64);
}

TEST(StepMetadata, TablesHoldOnlyTheLiveBlocks) {
  Caches c(1, 8192, 2048);
  std::vector<RunError> errors;
  c.blocks.open_request(1);
  int64_t pos = 0;
  for (int len : {2000, 1000, 1}) {
    const StepMetadata s = plan_step({{1, pos, len}}, c.config, c.blocks, errors);
    ASSERT_TRUE(errors.empty());
    check_metadata(s, c.blocks);
    // The SWA row starts at the window of the run's first token, the state
    // rows at the blocks its block ends pool: not at position 0.
    const StepView v = s.view();
    EXPECT_EQ(v.table(CacheGroup::kSwa).first[0], std::max<int64_t>(0, pos - 127) / 64);
    EXPECT_EQ(v.table(CacheGroup::kSwa).width, (pos + len - 1) / 64 - std::max<int64_t>(0, pos - 127) / 64 + 1);
    EXPECT_EQ(v.table(CacheGroup::kC4AState).first[0], std::max<int64_t>(0, pos / 4 - 1));
    EXPECT_EQ(v.table(CacheGroup::kC4A).first[0], 0);  // the whole compressed history
    c.blocks.commit(1, pos + len);
    pos += len;
  }
}

TEST(StepMetadata, DerivingFromTheInputsAloneRebuildsTheBuffer) {
  // What a GPU backend does: copy [0, inputs_end) and run derive_token.
  Caches c;
  std::vector<RunError> errors;
  c.blocks.open_request(1), c.blocks.open_request(2);
  const StepMetadata s = plan_step({{1, 0, 777}, {2, 0, 5}}, c.config, c.blocks, errors);
  std::vector<int32_t> copy(s.buffer().size(), 12345);  // poison: every array must be rewritten
  std::copy(s.buffer().begin(), s.buffer().begin() + s.layout().inputs_end, copy.begin());
  const StepView v = step_view(copy.data(), read_step_header(copy.data())), want = s.view();
  for (int t = 0; t < v.dims.tokens; ++t) derive_token(v, t);
  const int64_t T = v.dims.tokens, w = v.dims.c128a_width;
  auto same = [](const int32_t* a, const int32_t* b, int64_t n) { return std::equal(a, a + n, b); };
  EXPECT_TRUE(same(v.swa_slot, want.swa_slot, T));
  EXPECT_TRUE(same(v.c4a_slot, want.c4a_slot, T));
  EXPECT_TRUE(same(v.c128a_slot, want.c128a_slot, T));
  EXPECT_TRUE(same(v.c4a_state_slot, want.c4a_state_slot, T));
  EXPECT_TRUE(same(v.c128a_state_slot, want.c128a_state_slot, T));
  EXPECT_TRUE(same(v.window_indices, want.window_indices, T * kWindow));
  EXPECT_TRUE(same(v.window_lengths, want.window_lengths, T));
  EXPECT_TRUE(same(v.c128a_indices, want.c128a_indices, T * w));
  EXPECT_TRUE(same(v.c128a_lengths, want.c128a_lengths, T));
}

// For a backend that derives the lists itself (the CUDA backend): the
// inputs alone, the same bits as a full build's, and no view of lists that
// were never built.
TEST(StepMetadata, WithoutListsTheInputsAloneAreBuilt) {
  Caches c;
  std::vector<RunError> errors;
  c.blocks.open_request(1), c.blocks.open_request(2);
  const std::vector<dsv4::Run> runs = {{1, 0, 777}, {2, 0, 5}};
  const StepMetadata full = plan_step(runs, c.config, c.blocks, errors);
  const StepMetadata inputs = plan_step(runs, c.config, c.blocks, errors, false);  // the same run again: not yet committed
  ASSERT_TRUE(errors.empty());
  EXPECT_TRUE(full.has_lists());
  EXPECT_FALSE(inputs.has_lists());
  ASSERT_EQ(int64_t(inputs.buffer().size()), full.layout().inputs_end);
  EXPECT_TRUE(std::equal(inputs.buffer().begin(), inputs.buffer().end(), full.buffer().begin()));
  EXPECT_EQ(inputs.positions()[776], 776);
  EXPECT_EQ(inputs.token_run()[777], 1);
  try {
    (void)inputs.view();
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("built without its derived lists"), std::string::npos) << e.what();
  }
}

TEST(StepMetadata, BadRunsAreRejectedAndTheRestProceeds) {
  Caches c(1, 1024, 600);
  c.config.max_position_embeddings = 1000;
  c.blocks.open_request(1), c.blocks.open_request(2), c.blocks.open_request(3);
  std::vector<RunError> errors;
  auto s = plan_step({{1, 0, 5},        // fine
                      {99, 0, 4},       // unknown request
                      {2, 0, 0},        // zero length
                      {3, 7, 2},        // does not start where the request is
                      {1, 5, 1},        // same request twice in a step
                      {2, 0, 1001},     // past max_position_embeddings
                      {3, 0, 900}},     // more than the caches hold
                     c.config, c.blocks, errors);
  ASSERT_EQ(errors.size(), 6u);
  auto has = [&](size_t run, const std::string& text) {
    for (const auto& e : errors)
      if (e.run == run) return e.message.find(text) != std::string::npos;
    return false;
  };
  EXPECT_TRUE(has(1, "unknown request 99"));
  EXPECT_TRUE(has(2, "zero-length run"));
  EXPECT_TRUE(has(3, "starts at position 7 but the request holds 0"));
  EXPECT_TRUE(has(4, "more than one run"));
  EXPECT_TRUE(has(5, "max_position_embeddings"));
  EXPECT_TRUE(has(6, "exhausted"));
  ASSERT_EQ(s.runs.size(), 1u);
  EXPECT_EQ(s.input_index[0], 0u);
  check_metadata(s, c.blocks);
  // Nothing was reserved for the rejected runs.
  for (CacheGroup g : kAllCacheGroups) EXPECT_TRUE(c.blocks.table(g, 3).pages.empty());
}
