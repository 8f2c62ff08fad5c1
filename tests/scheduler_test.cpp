// The scheduler and the workload runner behind `dsv4 run`.
#include <gtest/gtest.h>

#include <map>

#include "runtime/workload.h"

using namespace dsv4;

TEST(Scheduler, FillsTheBudgetDecodeFirstWithContiguousRuns) {
  Scheduler s(SchedulerOptions{100, 3});
  for (int i = 0; i < 5; ++i) s.add({i, 70 + 10 * i, 3});
  std::map<int64_t, int64_t> pos;
  std::map<int64_t, int> decodes;
  int steps = 0;
  while (!s.done()) {
    ScheduledStep st = s.next_step();
    int tokens = 0;
    bool seen_prefill = false;
    for (size_t i = 0; i < st.runs.size(); ++i) {
      const dsv4::Run& r = st.runs[i];
      EXPECT_EQ(r.start_pos, pos[r.request]);  // each run continues its request
      pos[r.request] += r.len;
      tokens += r.len;
      if (st.decode[i]) {
        EXPECT_FALSE(seen_prefill) << "decode tokens come first";
        EXPECT_EQ(r.len, 1);
        ++decodes[r.request];
      } else {
        seen_prefill = true;
      }
    }
    EXPECT_LE(tokens, 100);
    EXPECT_LE(s.running(), 3u);
    std::vector<int64_t> finished, failed;
    s.complete(st, {}, finished, failed);
    EXPECT_TRUE(failed.empty());
    ASSERT_LT(++steps, 100);
  }
  for (int i = 0; i < 5; ++i) {
    EXPECT_EQ(pos[i], 70 + 10 * i + 3);
    EXPECT_EQ(decodes[i], 3);
  }
}

TEST(Scheduler, ARejectedRunDropsItsRequest) {
  Scheduler s(SchedulerOptions{64, 2});
  s.add({7, 10, 2});
  s.add({8, 10, 2});
  ScheduledStep st = s.next_step();
  ASSERT_EQ(st.runs.size(), 2u);
  std::vector<int64_t> finished, failed;
  s.complete(st, {1}, finished, failed);
  EXPECT_EQ(failed, std::vector<int64_t>{8});
  EXPECT_EQ(s.running(), 1u);
}

namespace {
WorkloadReport run_mini(int budget, uint64_t seed = 5) {
  const ModelConfig c = preset_config("mini");
  EngineOptions eo;
  eo.profile = Profile::kExact;
  eo.workload = CacheWorkload{4, 400, budget};
  auto engine = Engine::from_seed(c, 1, eo);
  Scheduler sched(SchedulerOptions{budget, 4});
  std::vector<WorkloadRequest> reqs = {{0, 300, 4}, {1, 131, 6}, {2, 3, 9}, {3, 260, 2}};
  return run_workload(*engine, sched, reqs, seed);
}
}  // namespace

TEST(Workload, ServesEveryRequestAndChunkingDoesNotChangeTheResult) {
  const WorkloadReport a = run_mini(512), b = run_mini(37);
  EXPECT_EQ(a.finished, 4);
  EXPECT_TRUE(a.errors.empty());
  EXPECT_EQ(a.prefill_tokens, 300 + 131 + 3 + 260);
  EXPECT_EQ(a.decode_tokens, 4 + 6 + 9 + 2);
  EXPECT_GT(b.steps, a.steps);
  EXPECT_GT(a.peak_cache_total, 0u);
  EXPECT_GT(a.checksum, 0.0);
  // Every token's final hidden state is the same however the steps were cut.
  EXPECT_NEAR(b.checksum, a.checksum, 1e-6 * a.checksum);
  EXPECT_NE(run_mini(512, 6).checksum, a.checksum);  // other inputs, other result
}
