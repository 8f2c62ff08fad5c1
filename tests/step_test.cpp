// Step metadata (SPEC §7) against positions computed by hand, and the
// rejection of bad runs while the rest of the step proceeds.
#include <gtest/gtest.h>

#include "runtime/step.h"

using namespace dsv4;

namespace {

CacheManager make_caches(const ModelConfig& c, int requests = 4) {
  return CacheManager(c, CacheOptions{true, IndexKeyFormat::kMxfp4, CacheCapacity::for_workload(requests, 4096, 2048)});
}

// Checks every per-token field of s against the definitions.
void check_metadata(const StepMetadata& s, const CacheManager& cm) {
  for (int t = 0; t < s.num_tokens(); ++t) {
    const int64_t id = s.runs[size_t(s.token_run[size_t(t)])].request, pos = s.positions[size_t(t)];
    EXPECT_EQ(s.swa_slot[size_t(t)], cm.slot(CacheGroup::kSwa, id, pos));
    const int len = int(std::min<int64_t>(pos + 1, 128));
    ASSERT_EQ(s.window_lengths[size_t(t)], len);
    for (int i = 0; i < 128; ++i) {
      const int32_t want = i < len ? cm.slot(CacheGroup::kSwa, id, pos - len + 1 + i) : -1;
      ASSERT_EQ(s.window_indices[size_t(t) * 128 + i], want) << "token " << t << " entry " << i;
    }
    EXPECT_EQ(s.c4a_slot[size_t(t)], (pos + 1) % 4 == 0 ? cm.slot(CacheGroup::kC4A, id, (pos + 1) / 4 - 1) : -1);
    EXPECT_EQ(s.c128a_slot[size_t(t)],
              (pos + 1) % 128 == 0 ? cm.slot(CacheGroup::kC128A, id, (pos + 1) / 128 - 1) : -1);
    EXPECT_EQ(s.c4a_state_slot[size_t(t)], cm.slot(CacheGroup::kC4AState, id, pos));
    EXPECT_EQ(s.c128a_state_slot[size_t(t)], cm.slot(CacheGroup::kC128AState, id, pos));
    const int visible = int((pos + 1) / 128);
    ASSERT_EQ(s.c128a_lengths[size_t(t)], visible);
    EXPECT_EQ(s.c128a_width % 64, 0);
    for (int j = 0; j < s.c128a_width; ++j)
      ASSERT_EQ(s.c128a_indices[size_t(t) * s.c128a_width + j], j < visible ? cm.slot(CacheGroup::kC128A, id, j) : -1);
  }
}

}  // namespace

TEST(StepMetadata, MixedPrefillAndDecodeMatchPositions) {
  const ModelConfig c = preset_config("mini");
  CacheManager cm = make_caches(c);
  std::vector<RunError> errors;
  cm.open_request(10), cm.open_request(11), cm.open_request(12);
  // Step 1: prefills of different lengths, one ending mid-block.
  auto s1 = plan_step({{10, 0, 300}, {11, 0, 3}, {12, 0, 131}}, c, cm, errors);
  ASSERT_TRUE(errors.empty());
  EXPECT_EQ(s1.num_tokens(), 434);
  check_metadata(s1, cm);
  for (const dsv4::Run& r : s1.runs) cm.commit(r.request, r.start_pos + r.len);
  // Step 2: a decode token, a chunk crossing a block boundary, another decode.
  auto s2 = plan_step({{10, 300, 1}, {11, 3, 254}, {12, 131, 1}}, c, cm, errors);
  ASSERT_TRUE(errors.empty());
  check_metadata(s2, cm);
  EXPECT_EQ(s2.token_begin, (std::vector<int>{0, 1, 255, 256}));
  EXPECT_EQ(s2.c128a_lengths[0], 2);   // position 300 sees slots 0, 1
  EXPECT_EQ(s2.c128a_width, 64);
}

TEST(StepMetadata, BadRunsAreRejectedAndTheRestProceeds) {
  ModelConfig c = preset_config("mini");
  c.max_position_embeddings = 1000;
  CacheManager cm(c, CacheOptions{true, IndexKeyFormat::kMxfp4, CacheCapacity::for_workload(2, 1024, 600)});
  cm.open_request(1), cm.open_request(2), cm.open_request(3);
  std::vector<RunError> errors;
  auto s = plan_step({{1, 0, 5},        // fine
                      {99, 0, 4},       // unknown request
                      {2, 0, 0},        // zero length
                      {3, 7, 2},        // does not start where the request is
                      {1, 5, 1},        // same request twice in a step
                      {2, 0, 1001},     // past max_position_embeddings
                      {3, 0, 900}},     // more than the caches hold
                     c, cm, errors);
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
  check_metadata(s, cm);
  // Nothing was reserved for the rejected runs.
  for (CacheGroup g : kAllCacheGroups) EXPECT_TRUE(cm.table(g, 3).empty());
}
