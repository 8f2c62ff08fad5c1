// Block pool and paged caches (SPEC §6): allocation, exhaustion, freeing by position.
#include <gtest/gtest.h>

#include <set>

#include "cache/cache_manager.h"
#include "model/config.h"

using namespace dsv4;

TEST(BlockPool, AllocatesEveryPageOnceThenReportsExhaustion) {
  BlockPool pool(3);
  std::set<int32_t> got;
  for (int i = 0; i < 3; ++i) got.insert(pool.allocate());
  EXPECT_EQ(got, (std::set<int32_t>{0, 1, 2}));
  EXPECT_EQ(pool.allocate(), -1);
  pool.release(1);
  EXPECT_EQ(pool.allocate(), 1);
  EXPECT_THROW(pool.release(7), std::runtime_error);
  pool.release(2);
  EXPECT_THROW(pool.release(2), std::runtime_error);  // double free
}

namespace {
CacheOptions small_caches(int32_t swa, int32_t c4a, int32_t c128a, int32_t s4, int32_t s128) {
  CacheOptions o;
  o.capacity[CacheGroup::kSwa] = swa, o.capacity[CacheGroup::kC4A] = c4a, o.capacity[CacheGroup::kC128A] = c128a;
  o.capacity[CacheGroup::kC4AState] = s4, o.capacity[CacheGroup::kC128AState] = s128;
  return o;
}
}  // namespace

TEST(CacheManager, SlotsFollowTheBlockTables) {
  CacheManager cm(preset_config("mini"), small_caches(16, 8, 8, 200, 8));
  cm.open_request(5);
  cm.reserve(5, 0, 300);
  const auto& swa = cm.table(CacheGroup::kSwa, 5);
  ASSERT_EQ(swa.size(), 5u);  // positions 0..299 in 64-token pages
  for (int64_t pos : {0, 63, 64, 299})
    EXPECT_EQ(cm.slot(CacheGroup::kSwa, 5, pos), swa[size_t(pos / 64)] * 64 + pos % 64);
  // Compressed entries: slots 0..74 (C4A, 64 per page), 0..1 (C128A, 2 per page).
  EXPECT_EQ(cm.table(CacheGroup::kC4A, 5).size(), 2u);
  EXPECT_EQ(cm.table(CacheGroup::kC128A, 5).size(), 1u);
  EXPECT_EQ(cm.slot(CacheGroup::kC128A, 5, 1), cm.table(CacheGroup::kC128A, 5)[0] * 2 + 1);
  EXPECT_THROW(cm.slot(CacheGroup::kC128A, 5, 2), std::runtime_error);  // slot 2 completes at 383
}

TEST(CacheManager, CommitFreesWhatNoLaterTokenReads) {
  CacheManager cm(preset_config("mini"), small_caches(16, 8, 8, 200, 8));
  cm.open_request(1);
  cm.reserve(1, 0, 300);
  cm.commit(1, 300);
  // The next token (300) reads positions 173..300: SWA pages 0 and 1 (0..127) are out.
  const auto& swa = cm.table(CacheGroup::kSwa, 1);
  EXPECT_EQ(swa[0], -1);
  EXPECT_EQ(swa[1], -1);
  EXPECT_GE(swa[2], 0);
  EXPECT_EQ(cm.pool(CacheGroup::kSwa).used_count(), 3);
  // C4A state: the next slot (75) pools blocks 74 and 75; blocks 0..73 are gone.
  const auto& s4 = cm.table(CacheGroup::kC4AState, 1);
  EXPECT_EQ(s4[73], -1);
  EXPECT_GE(s4[74], 0);
  EXPECT_EQ(cm.pool(CacheGroup::kC4AState).used_count(), 1);
  // C128A state: slot 2 pools block 2 (positions 256..383): blocks 0, 1 are gone.
  EXPECT_EQ(cm.pool(CacheGroup::kC128AState).used_count(), 1);
  // Compressed entries are history: all kept.
  EXPECT_EQ(cm.pool(CacheGroup::kC4A).used_count(), 2);
  EXPECT_EQ(cm.tokens_held(), 300);
  cm.close_request(1);
  for (CacheGroup g : kAllCacheGroups) EXPECT_EQ(cm.pool(g).used_count(), 0) << cache_group_name(g);
}

TEST(CacheManager, ExhaustionFailsOneRequestAndTouchesNoOther) {
  CacheManager cm(preset_config("mini"), small_caches(6, 8, 8, 200, 8));
  cm.open_request(1);
  cm.open_request(2);
  cm.reserve(1, 0, 200);  // 4 SWA pages
  const auto before = cm.table(CacheGroup::kSwa, 1);
  try {
    cm.reserve(2, 0, 200);  // needs 4, 2 free
    FAIL() << "expected exhaustion";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("cache 'swa' is exhausted"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("request 2"), std::string::npos) << e.what();
  }
  // All or nothing: request 2 holds nothing, request 1 is as it was.
  for (CacheGroup g : kAllCacheGroups) EXPECT_TRUE(cm.table(g, 2).empty()) << cache_group_name(g);
  EXPECT_EQ(cm.table(CacheGroup::kSwa, 1), before);
  EXPECT_EQ(cm.pool(CacheGroup::kSwa).free_count(), 2);
  cm.reserve(2, 0, 100);  // what fits still works
}

TEST(CacheManager, UnknownAndDuplicateRequests) {
  CacheManager cm(preset_config("mini"), small_caches(4, 4, 4, 8, 4));
  EXPECT_THROW(cm.reserve(9, 0, 1), std::runtime_error);
  EXPECT_THROW(cm.close_request(9), std::runtime_error);
  cm.open_request(9);
  EXPECT_THROW(cm.open_request(9), std::runtime_error);
}
