// Block pool, block manager and host storage (SPEC §6): allocation,
// exhaustion, freeing by position, shared pages, memory that follows use.
#include <gtest/gtest.h>

#include <algorithm>
#include <random>
#include <set>
#include <string>
#include <utility>

#include "cache/block_manager.h"
#include "cache/host_storage.h"
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

TEST(BlockPool, SharedPagesAreFreedByTheirLastHolder) {
  BlockPool pool(4);
  const int32_t p = pool.allocate();
  pool.retain(p);  // a second request shares the page
  pool.set_hash(p, 0x1234);
  EXPECT_EQ(pool.ref_count(p), 2);
  pool.release(p);
  EXPECT_EQ(pool.used_count(), 1);  // still held by the other
  EXPECT_EQ(pool.hash(p), 0x1234u);
  pool.release(p);
  EXPECT_EQ(pool.used_count(), 0);
  EXPECT_EQ(pool.hash(p), 0u);  // a freed page forgets its content
  EXPECT_THROW(pool.retain(p), std::runtime_error);
}

TEST(BlockPool, HandsOutTheLowestFreeIdSoStorageStaysCompact) {
  BlockPool pool(8);
  for (int i = 0; i < 6; ++i) pool.allocate();
  pool.release(4), pool.release(1), pool.release(3);
  EXPECT_EQ(pool.allocate(), 1);
  EXPECT_EQ(pool.allocate(), 3);
  EXPECT_EQ(pool.high_water(), 6);
}

namespace {

struct Caches {
  ModelConfig config = preset_config("mini");
  CacheSpec spec{config, CacheFormats{}};
  BlockManager blocks;
  Caches(int32_t swa, int32_t c4a, int32_t c128a, int32_t s4, int32_t s128, int64_t max_bytes = INT64_MAX)
      : blocks(spec, limits(swa, c4a, c128a, s4, s128, max_bytes)) {}
  static CacheLimits limits(int32_t swa, int32_t c4a, int32_t c128a, int32_t s4, int32_t s128, int64_t max_bytes) {
    CacheLimits l;
    l[CacheGroup::kSwa] = swa, l[CacheGroup::kC4A] = c4a, l[CacheGroup::kC128A] = c128a;
    l[CacheGroup::kC4AState] = s4, l[CacheGroup::kC128AState] = s128;
    l.max_bytes = max_bytes;
    return l;
  }
};

}  // namespace

TEST(BlockManager, SlotsFollowTheBlockTables) {
  Caches c(16, 8, 8, 200, 8);
  BlockManager& bm = c.blocks;
  bm.open_request(5);
  bm.reserve(5, 0, 300);
  const BlockTableRef swa = bm.table(CacheGroup::kSwa, 5);
  ASSERT_EQ(swa.pages.size(), 5u);  // positions 0..299 in 64-token pages
  EXPECT_EQ(swa.first, 0);
  for (int64_t pos : {0, 63, 64, 299})
    EXPECT_EQ(bm.slot(CacheGroup::kSwa, 5, pos), swa.pages[size_t(pos / 64)] * 64 + pos % 64);
  // Compressed entries: slots 0..74 (C4A, 64 per page), 0..1 (C128A, 2 per page).
  EXPECT_EQ(bm.table(CacheGroup::kC4A, 5).pages.size(), 2u);
  EXPECT_EQ(bm.table(CacheGroup::kC128A, 5).pages.size(), 1u);
  EXPECT_EQ(bm.slot(CacheGroup::kC128A, 5, 1), bm.table(CacheGroup::kC128A, 5).pages[0] * 2 + 1);
  EXPECT_THROW(bm.slot(CacheGroup::kC128A, 5, 2), std::runtime_error);  // slot 2 completes at 383
}

TEST(BlockManager, CommitFreesWhatNoLaterTokenReads) {
  Caches c(16, 8, 8, 200, 8);
  BlockManager& bm = c.blocks;
  bm.open_request(1);
  bm.reserve(1, 0, 300);
  bm.commit(1, 300);
  // The next token (300) reads positions 173..300: SWA blocks 0 and 1 (0..127) are out.
  const BlockTableRef swa = bm.table(CacheGroup::kSwa, 1);
  EXPECT_EQ(swa.first, 2);
  EXPECT_EQ(swa.pages.size(), 3u);
  EXPECT_EQ(bm.pool(CacheGroup::kSwa).used_count(), 3);
  EXPECT_THROW(bm.slot(CacheGroup::kSwa, 1, 127), std::runtime_error);
  EXPECT_NO_THROW(bm.slot(CacheGroup::kSwa, 1, 128));
  // C4A state: the next slot (75) pools blocks 74 and 75; blocks 0..73 are gone.
  EXPECT_EQ(bm.table(CacheGroup::kC4AState, 1).first, 74);
  EXPECT_EQ(bm.pool(CacheGroup::kC4AState).used_count(), 1);
  // C128A state: slot 2 pools block 2 (positions 256..383): blocks 0, 1 are gone.
  EXPECT_EQ(bm.pool(CacheGroup::kC128AState).used_count(), 1);
  // Compressed entries are history: all kept.
  EXPECT_EQ(bm.pool(CacheGroup::kC4A).used_count(), 2);
  EXPECT_EQ(bm.tokens_held(), 300);
  // Bytes follow the pages in use.
  int64_t bytes = 0;
  for (CacheGroup g : kAllCacheGroups)
    bytes += int64_t(bm.pool(g).used_count()) * int64_t(c.spec.group(g).page_bytes);
  EXPECT_EQ(bm.bytes_in_use(), bytes);
  bm.close_request(1);
  for (CacheGroup g : kAllCacheGroups) EXPECT_EQ(bm.pool(g).used_count(), 0) << cache_group_name(g);
  EXPECT_EQ(bm.bytes_in_use(), 0);
}

// A state block that a run's own tokens fill and no later token reads gets
// no page (the compressors pool those rows from the projection): a chunk
// keeps only the blocks its last entries leave open, whatever its length.
TEST(BlockManager, StateBlocksOnlyWhereALaterTokenReadsThem) {
  Caches c(400, 100, 100, 200, 8);
  BlockManager& bm = c.blocks;
  bm.open_request(1), bm.open_request(2);
  bm.reserve(1, 0, 8192);  // ends on a C128A block end: no C128A state left open
  const BlockTableRef s4 = bm.table(CacheGroup::kC4AState, 1);
  EXPECT_EQ(s4.first, 2047);  // the next slot (2048) pools blocks 2047 and 2048
  EXPECT_EQ(s4.pages.size(), 1u);
  EXPECT_EQ(bm.table(CacheGroup::kC128AState, 1).pages.size(), 0u);
  bm.reserve(2, 0, 8190);  // ends inside a block
  EXPECT_EQ(bm.table(CacheGroup::kC4AState, 2).first, 2046);
  EXPECT_EQ(bm.table(CacheGroup::kC4AState, 2).pages.size(), 2u);
  EXPECT_EQ(bm.table(CacheGroup::kC128AState, 2).first, 63);
  EXPECT_EQ(bm.table(CacheGroup::kC128AState, 2).pages.size(), 1u);
  EXPECT_EQ(bm.pool(CacheGroup::kC4AState).used_count(), 3);
  EXPECT_EQ(bm.pool(CacheGroup::kC128AState).used_count(), 1);
  // The other groups as before: every SWA block of the chunk, every entry.
  EXPECT_EQ(bm.table(CacheGroup::kSwa, 2).pages.size(), 128u);
  EXPECT_EQ(bm.table(CacheGroup::kC4A, 2).pages.size(), 32u);
  // The next chunk of request 2 keeps the blocks it reads (2046, 2047; 63)
  // until its commit, and skips its own dead ones.
  bm.commit(2, 8190);
  bm.reserve(2, 8190, 300);  // positions 8190..8489: slots 2047..2121
  const BlockTableRef next = bm.table(CacheGroup::kC4AState, 2);
  EXPECT_EQ(next.first, 2046);
  int held = 0;
  for (int32_t p : next.pages) held += p >= 0;
  EXPECT_EQ(held, 4);  // 2046, 2047 and the open ones 2121, 2122
  EXPECT_GE(next.pages[size_t(2122 - next.first)], 0);
  EXPECT_LT(next.pages[size_t(2100 - next.first)], 0);
  EXPECT_NO_THROW(bm.slot(CacheGroup::kC128AState, 2, 8191));  // block 63 still pooled by slot 63
  bm.commit(2, 8490);
  EXPECT_EQ(bm.table(CacheGroup::kC4AState, 2).first, 2121);
  EXPECT_EQ(bm.pool(CacheGroup::kC4AState).used_count(), 1 + 2);
  // Planning the same run twice (nothing committed in between) is no error.
  EXPECT_NO_THROW(bm.reserve(1, 0, 8192));
  // A one-token run never skips: its block is the one the next token reads.
  for (int64_t pos = 0; pos < 20; ++pos)
    for (CacheGroup g : {CacheGroup::kC4AState, CacheGroup::kC128AState})
      EXPECT_TRUE(c.spec.needs_page(g, pos / group_entries_per_page(g), pos, 1)) << pos;
  EXPECT_TRUE(c.spec.needs_page(CacheGroup::kSwa, 3, 0, 8192));
  EXPECT_FALSE(c.spec.needs_page(CacheGroup::kC4AState, 3, 0, 8192));
}

// The state pages for_workload sets aside hold any schedule of the
// workload: random runs of up to `step` tokens a step over `requests`
// requests never exhaust them.
TEST(BlockManager, WorkloadLimitsHoldTheStateOfAnySchedule) {
  const ModelConfig config = preset_config("mini");
  const CacheSpec spec(config, CacheFormats{});
  std::mt19937_64 rng(7);
  for (auto [requests, step] : {std::pair{1, 8192}, {4, 512}, {16, 16}, {16, 2048}, {7, 37}}) {
    BlockManager bm(spec, CacheLimits::for_workload(spec, requests, 65536, step));
    std::vector<int64_t> length(size_t(requests), 0);
    for (int r = 0; r < requests; ++r) bm.open_request(r);
    for (int s = 0; s < 200; ++s) {
      int64_t budget = step;
      std::vector<std::pair<int, int64_t>> runs;
      for (int r = 0; r < requests && budget > 0; ++r) {
        const int64_t len = std::min<int64_t>(budget, rng() % 3 == 0 ? 1 : 1 + int64_t(rng() % uint64_t(step)));
        if (length[size_t(r)] + len > 65536) continue;
        ASSERT_NO_THROW(bm.reserve(r, length[size_t(r)], int(len)))
            << requests << " requests, step " << step << ": request " << r << " at " << length[size_t(r)]
            << " +" << len;
        runs.emplace_back(r, len), budget -= len;
      }
      for (auto [r, len] : runs) bm.commit(r, length[size_t(r)] += len);
    }
  }
}

TEST(BlockManager, ExhaustionFailsOneRequestAndTouchesNoOther) {
  Caches c(6, 8, 8, 200, 8);
  BlockManager& bm = c.blocks;
  bm.open_request(1);
  bm.open_request(2);
  bm.reserve(1, 0, 200);  // 4 SWA pages
  const auto before = std::vector<int32_t>(bm.table(CacheGroup::kSwa, 1).pages.begin(),
                                           bm.table(CacheGroup::kSwa, 1).pages.end());
  try {
    bm.reserve(2, 0, 200);  // needs 4, 2 free
    FAIL() << "expected exhaustion";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("cache 'swa' is exhausted"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("request 2"), std::string::npos) << e.what();
  }
  // All or nothing: request 2 holds nothing, request 1 is as it was.
  for (CacheGroup g : kAllCacheGroups) EXPECT_TRUE(bm.table(g, 2).pages.empty()) << cache_group_name(g);
  EXPECT_EQ(std::vector<int32_t>(bm.table(CacheGroup::kSwa, 1).pages.begin(), bm.table(CacheGroup::kSwa, 1).pages.end()),
            before);
  EXPECT_EQ(bm.pool(CacheGroup::kSwa).free_count(), 2);
  bm.reserve(2, 0, 100);  // what fits still works
}

TEST(BlockManager, TheByteLimitRefusesARunAndTouchesNothing) {
  ModelConfig config = preset_config("mini");
  CacheSpec spec(config, CacheFormats{});
  // Room for request 1's 300 tokens, not for request 2's as well.
  BlockManager probe(spec, Caches::limits(64, 64, 64, 400, 64, INT64_MAX));
  probe.open_request(1);
  probe.reserve(1, 0, 300);
  const int64_t one = probe.bytes_in_use();
  BlockManager bm(spec, Caches::limits(64, 64, 64, 400, 64, one + one / 2));
  bm.open_request(1), bm.open_request(2);
  bm.reserve(1, 0, 300);
  try {
    bm.reserve(2, 0, 300);
    FAIL() << "expected the byte limit";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("more bytes of cache"), std::string::npos) << e.what();
  }
  EXPECT_EQ(bm.bytes_in_use(), one);
  for (CacheGroup g : kAllCacheGroups) EXPECT_TRUE(bm.table(g, 2).pages.empty());
}

// why_never_fits is a shortcut over the last 256 positions; the real thing
// is a request served one token a step with the caches to itself. Its peak
// pages per group and peak bytes are exactly the limits at which the
// shortcut says "fits", and one page or byte less "never fits".
TEST(BlockManager, NeverFitsIsExactlyWhereOneTokenAStepRunsOut) {
  const ModelConfig config = preset_config("mini");
  const CacheSpec spec(config, CacheFormats{});
  constexpr int32_t kAmple = 1 << 20;
  for (int64_t length : {1, 3, 4, 5, 64, 127, 128, 129, 191, 192, 255, 256, 257, 300, 517, 1030}) {
    BlockManager run(spec, Caches::limits(kAmple, kAmple, kAmple, kAmple, kAmple, INT64_MAX));
    run.open_request(0);
    std::array<int32_t, kNumCacheGroups> peak_pages{};
    int64_t peak_bytes = 0;
    for (int64_t p = 0; p < length; ++p) {
      run.reserve(0, p, 1);
      for (CacheGroup g : kAllCacheGroups)
        peak_pages[size_t(g)] = std::max(peak_pages[size_t(g)], run.pool(g).capacity() - run.pool(g).free_count());
      peak_bytes = std::max(peak_bytes, run.bytes_in_use());
      run.commit(0, p + 1);
    }
    const auto limits = [&](int64_t max_bytes, CacheGroup short_of = CacheGroup::kSwa, int32_t less = 0) {
      CacheLimits l;
      for (CacheGroup g : kAllCacheGroups) l[g] = std::max(1, peak_pages[size_t(g)] - (g == short_of ? less : 0));
      l.max_bytes = max_bytes;
      return l;
    };
    const std::string at = "length " + std::to_string(length);
    EXPECT_EQ(BlockManager(spec, limits(peak_bytes)).why_never_fits(length), "") << at;
    const std::string bytes = BlockManager(spec, limits(peak_bytes - 1)).why_never_fits(length);
    EXPECT_NE(bytes.find("bytes of cache, beyond the limit of " + std::to_string(peak_bytes - 1)), std::string::npos)
        << at << ": " << bytes;
    EXPECT_NE(bytes.find("it cannot fit"), std::string::npos) << bytes;
    for (CacheGroup g : kAllCacheGroups) {
      if (peak_pages[size_t(g)] < 2) continue;  // a used group keeps at least one page
      const std::string pages = BlockManager(spec, limits(INT64_MAX, g, 1)).why_never_fits(length);
      EXPECT_NE(pages.find("pages of cache '" + std::string(cache_group_name(g)) + "', which has " +
                           std::to_string(peak_pages[size_t(g)] - 1)),
                std::string::npos)
          << at << ": " << pages;
    }
  }
}

// A longer request reaches every position a shorter one does, so once a
// length cannot fit no longer one can (`dsv4 run` remembers where the verdict
// turns and asks only between). Checked at every length up to 1,100 under
// byte limits and page limits that turn at several places (129 to 1,028).
TEST(BlockManager, NeverFitsOnlyWorsensWithLength) {
  const ModelConfig config = preset_config("mini");
  const CacheSpec spec(config, CacheFormats{});
  constexpr int32_t kAmple = 1 << 20;
  std::vector<CacheLimits> cases;
  for (int64_t bytes : {int64_t(900) << 10, int64_t(1) << 20, int64_t(1100) << 10})
    cases.push_back(Caches::limits(kAmple, kAmple, kAmple, kAmple, kAmple, bytes));
  for (int32_t pages : {2, 3, 4}) cases.push_back(Caches::limits(kAmple, pages, kAmple, kAmple, kAmple, INT64_MAX));
  int turns = 0;
  for (const CacheLimits& l : cases) {
    const BlockManager bm(spec, l);
    int64_t first_failing = -1;
    for (int64_t length = 1; length <= 1100; ++length) {
      const bool fails = !bm.why_never_fits(length).empty();
      if (first_failing < 0 && fails) first_failing = length;
      ASSERT_EQ(fails, first_failing >= 0) << "fits at " << length << " after failing at " << first_failing;
    }
    turns += first_failing > 1;  // it turns inside the range, not at its start or past it
  }
  EXPECT_EQ(turns, int(cases.size()));
}

TEST(BlockManager, UnknownAndDuplicateRequests) {
  Caches c(4, 4, 4, 8, 4);
  BlockManager& bm = c.blocks;
  EXPECT_THROW(bm.reserve(9, 0, 1), std::runtime_error);
  EXPECT_THROW(bm.close_request(9), std::runtime_error);
  bm.open_request(9);
  EXPECT_THROW(bm.open_request(9), std::runtime_error);
}

TEST(BlockManager, LimitsForAHugeWorkloadStayWithin32BitSlots) {
  const ModelConfig config = preset_config("flash");
  const CacheSpec spec(config, CacheFormats{});
  const CacheLimits l = CacheLimits::for_workload(spec, 1 << 20, int64_t(1) << 40, 1 << 30);
  for (CacheGroup g : kAllCacheGroups)
    EXPECT_LE(int64_t(l[g]) * spec.group(g).entries_per_page, INT32_MAX) << cache_group_name(g);
  EXPECT_NO_THROW(BlockManager(spec, l));  // ids cost nothing until used
}

// A memory budget (the device caches' arenas) keeps the workload's SWA and
// compressor-state pages and gives the compressed groups what is left, a page
// of each at a time; a budget without room for one such page is refused with
// the sizes.
TEST(BlockManager, LimitsForMemoryShareWhatTheFixedGroupsLeave) {
  const ModelConfig config = preset_config("small");
  const CacheSpec spec(config, CacheFormats{});
  const CacheLimits w = CacheLimits::for_workload(spec, 4, 2048, 512);
  int64_t fixed = 0, per_page = 0;
  for (CacheGroup g : kAllCacheGroups) {
    if (group_grows_with_context(g)) per_page += int64_t(spec.group(g).page_bytes);
    else fixed += int64_t(w[g]) * spec.group(g).page_bytes;
  }
  const CacheLimits l = CacheLimits::for_memory(spec, 4, 2048, 512, fixed + 3 * per_page + per_page / 2);
  for (CacheGroup g : kAllCacheGroups) {
    EXPECT_EQ(l[g], group_grows_with_context(g) ? 3 : w[g]) << cache_group_name(g);
  }
  EXPECT_LE(l.bytes(spec), l.max_bytes);
  EXPECT_EQ(CacheLimits::for_memory(spec, 4, 2048, 512, INT64_MAX / 4).bytes(spec), w.bytes(spec));  // never more
  try {
    CacheLimits::for_memory(spec, 4, 2048, 512, fixed + per_page - 1);
    ADD_FAILURE() << "a budget without a page of compressed entries was accepted";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("(" + std::to_string(fixed) + " bytes) and a page of compressed entries (" +
                                         std::to_string(per_page) + " bytes)"),
              std::string::npos)
        << e.what();
  }
}

// A cache arena grows in place (mremap): its bytes survive each growth,
// bytes never written read as zero, it never shrinks, and its room doubles,
// so growing page by page remaps O(log n) times.
TEST(HostArena, GrowsKeepingItsBytesAndZeroFillingTheRest) {
  HostArena a;
  EXPECT_EQ(a.size(), 0u);
  a.grow(1000);
  ASSERT_NE(a.data(), nullptr);
  for (size_t i = 0; i < 1000; ++i) {
    EXPECT_EQ(a[i], 0);
    a[i] = uint8_t(i * 7 + 1);
  }
  size_t remaps = 0, room = a.reserved();
  for (size_t n = 1000; n <= (size_t(64) << 20); n += 4096 * 37) {  // to 64 MiB in steps of 37 pages
    a.grow(n);
    remaps += a.reserved() != room;
    room = a.reserved();
    ASSERT_GE(a.reserved(), a.size());
  }
  EXPECT_LE(remaps, 16u);
  for (size_t i = 0; i < 1000; ++i) ASSERT_EQ(a[i], uint8_t(i * 7 + 1)) << i;
  for (size_t i = 1000; i < a.size(); i += 4093) ASSERT_EQ(a[i], 0) << i;
  const size_t size = a.size();
  a.grow(10);  // never shrinks
  EXPECT_EQ(a.size(), size);
  HostArena b = std::move(a);
  EXPECT_EQ(b.size(), size);
  EXPECT_EQ(a.data(), nullptr);
  EXPECT_EQ(b[999], uint8_t(999 * 7 + 1));
}

TEST(HostCacheStorage, GrowsWithThePagesInUseOnly) {
  const ModelConfig config = preset_config("mini");
  const CacheSpec spec(config, CacheFormats{});
  HostCacheStorage storage(spec);
  EXPECT_EQ(storage.bytes_allocated(), 0);
  storage.ensure_pages(CacheGroup::kSwa, 3);
  EXPECT_EQ(storage.bytes_allocated(), 3 * int64_t(spec.group(CacheGroup::kSwa).page_bytes));
  const KvPagesMut swa0 = storage.pages(0, CacheKind::kSwa);
  EXPECT_EQ(swa0.num_pages, 3);
  EXPECT_EQ(swa0.entries_per_page, 64);
  EXPECT_FALSE(storage.pages(0, CacheKind::kCompressed).base);  // layer 0 is SWA-only
  storage.ensure_pages(CacheGroup::kSwa, 2);  // never shrinks
  EXPECT_EQ(storage.pages(0, CacheKind::kSwa).num_pages, 3);
  // What a page holds survives the arena's growth; new pages are zero.
  const size_t stride = storage.pages(0, CacheKind::kSwa).page_stride;
  storage.pages(0, CacheKind::kSwa).base[2 * stride + 5] = 0xab;
  storage.ensure_pages(CacheGroup::kSwa, 3000);
  const KvPagesMut grown = storage.pages(0, CacheKind::kSwa);
  EXPECT_EQ(grown.base[2 * stride + 5], 0xab);
  EXPECT_EQ(grown.base[2999 * stride + 5], 0);
}
