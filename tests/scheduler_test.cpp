// The scheduler and the workload runner behind `dsv4 run`.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <map>
#include <random>
#include <set>

#include "common/error.h"
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
    const StepOutcome out = s.complete(st, {});
    EXPECT_TRUE(out.failed.empty());
    EXPECT_TRUE(out.preempted.empty());
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
  const StepOutcome out = s.complete(st, {RunError{1, "request 8: bad run"}});
  ASSERT_EQ(out.failed.size(), 1u);
  EXPECT_EQ(out.failed[0].request, 8);
  EXPECT_EQ(out.failed[0].reason, "request 8: bad run");
  EXPECT_EQ(s.running(), 1u);
  EXPECT_THROW(s.complete(s.next_step(), {RunError{5, "no such run"}}), Error);
}

namespace {
RunError cache_full(size_t run) { return RunError{run, "cache full", true}; }
const dsv4::Run* run_of(const ScheduledStep& st, int64_t request) {
  for (const dsv4::Run& r : st.runs)
    if (r.request == request) return &r;
  return nullptr;
}
}  // namespace

// Request 1's run does not fit: it stalls and keeps its place; request 2,
// younger and holding pages, is preempted and waits behind it, then starts
// again from position 0.
TEST(Scheduler, AStalledRunPreemptsTheYoungestHolder) {
  Scheduler s(SchedulerOptions{64, 3});
  for (int i = 0; i < 3; ++i) s.add({i, 10, 2});
  ScheduledStep st = s.next_step();
  ASSERT_EQ(st.runs.size(), 3u);
  StepOutcome out = s.complete(st, {cache_full(1)});
  EXPECT_EQ(out.preempted, std::vector<int64_t>{2});
  EXPECT_EQ(out.recomputed_tokens, 10);
  EXPECT_TRUE(out.failed.empty());
  EXPECT_TRUE(out.finished.empty());
  st = s.next_step();
  EXPECT_TRUE(st.admitted.empty());  // 2 waits behind 1, not admitted to hold its place for nothing
  ASSERT_EQ(st.runs.size(), 2u);     // 0 decodes, 1 retries
  EXPECT_TRUE(st.decode[0]);
  EXPECT_EQ(st.runs[0].request, 0);
  ASSERT_NE(run_of(st, 1), nullptr);
  EXPECT_EQ(run_of(st, 1)->start_pos, 0);
  EXPECT_EQ(run_of(st, 1)->len, 10);
  out = s.complete(st, {});
  EXPECT_TRUE(out.preempted.empty());
  st = s.next_step();
  EXPECT_EQ(st.admitted, std::vector<int64_t>{2});
  ASSERT_NE(run_of(st, 2), nullptr);
  EXPECT_EQ(run_of(st, 2)->start_pos, 0);
  EXPECT_EQ(run_of(st, 2)->len, 10);
}

// Nothing younger holds pages, an older request does: the stalled one waits.
TEST(Scheduler, AStalledRequestWaitsForAnOlderOne) {
  Scheduler s(SchedulerOptions{64, 2});
  s.add({0, 10, 3});
  s.add({1, 10, 1});
  ScheduledStep st = s.next_step();
  const StepOutcome out = s.complete(st, {cache_full(1)});
  EXPECT_TRUE(out.preempted.empty());
  EXPECT_TRUE(out.failed.empty());
  EXPECT_EQ(s.running(), 2u);
  st = s.next_step();
  ASSERT_EQ(st.runs.size(), 2u);
  EXPECT_EQ(st.runs[0].request, 0);
  EXPECT_EQ(st.runs[1].request, 1);
  EXPECT_EQ(st.runs[1].start_pos, 0);
}

// A younger request that finishes in the same step gives its pages back:
// the stalled one waits for them instead of counting itself alone.
TEST(Scheduler, AStalledRequestWaitsForPagesAFinishingRequestGivesBack) {
  Scheduler s(SchedulerOptions{64, 2});
  s.add({0, 1, 1});
  s.add({1, 5, 0});
  const StepOutcome out = s.complete(s.next_step(), {cache_full(0)});
  EXPECT_TRUE(out.failed.empty());
  EXPECT_TRUE(out.preempted.empty());
  EXPECT_EQ(out.finished, std::vector<int64_t>{1});
  EXPECT_EQ(s.running(), 1u);
}

// Alone, a prefill chunk that does not fit is halved until it does; a
// single token that does not fit fails its request with the reason.
TEST(Scheduler, AloneAChunkIsHalvedThenItsRequestFails) {
  Scheduler s(SchedulerOptions{64, 2});
  s.add({0, 40, 1});
  std::vector<int> lens;
  StepOutcome out;
  for (int i = 0; i < 10 && out.failed.empty(); ++i) {
    const ScheduledStep st = s.next_step();
    ASSERT_EQ(st.runs.size(), 1u);
    lens.push_back(st.runs[0].len);
    out = s.complete(st, {cache_full(0)});
  }
  EXPECT_EQ(lens, (std::vector<int>{40, 20, 10, 5, 2, 1}));
  ASSERT_EQ(out.failed.size(), 1u);
  EXPECT_EQ(out.failed[0].reason, "cache full (no other request holds cache pages: it cannot fit)");
  EXPECT_TRUE(s.done());
  // A halved chunk that fits: the cap doubles again for the next one.
  Scheduler t(SchedulerOptions{64, 2});
  t.add({0, 200, 1});
  t.complete(t.next_step(), {cache_full(0)});
  t.complete(t.next_step(), {cache_full(0)});
  ScheduledStep st = t.next_step();
  EXPECT_EQ(st.runs[0].len, 16);
  t.complete(st, {});
  st = t.next_step();
  EXPECT_EQ(st.runs[0].start_pos, 16);
  EXPECT_EQ(st.runs[0].len, 32);
  t.complete(st, {});
  st = t.next_step();
  EXPECT_EQ(st.runs[0].start_pos, 48);
  EXPECT_EQ(st.runs[0].len, 64);
}

// Each request admitted gets a token of the step's budget: with room for
// many more running requests than tokens, the rest wait in the queue (opened,
// they would hold their place for nothing).
TEST(Scheduler, AdmitsNoMoreRequestsThanTheBudgetHasTokensFor) {
  Scheduler s(SchedulerOptions{4, INT32_MAX});
  for (int i = 0; i < 100; ++i) s.add({i, 3, 0});
  EXPECT_FALSE(s.wants_requests());  // more queued than any step can admit
  ScheduledStep st = s.next_step();
  EXPECT_EQ(st.admitted, (std::vector<int64_t>{0, 1}));  // 3 tokens, then 1
  EXPECT_EQ(s.running(), 2u);
  s.complete(st, {});
  st = s.next_step();  // 0 has finished
  EXPECT_EQ(st.admitted, std::vector<int64_t>{2});  // 1's last 2 tokens first, then 2 of 2's
  EXPECT_EQ(s.running(), 2u);
}

// Random workloads against a model of the caches: a request holds a unit a
// token, and a run needs its tokens' units plus as many transient ones (its
// compressor rows), given back when it commits. Every workload must end; a
// request is served exactly when it fits alone (its tokens plus the last
// token's transient unit), else rejected.
TEST(Scheduler, RandomWorkloadsEndAndServeEveryRequestThatFitsAlone) {
  std::mt19937 rng(7);
  int preemptions = 0, stalls = 0, rejected_requests = 0;
  for (int trial = 0; trial < 300; ++trial) {
    auto pick = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
    const int limit = pick(2, 120);
    Scheduler s(SchedulerOptions{pick(1, 64), pick(1, 6)});
    std::map<int64_t, int64_t> total, held;
    for (int i = 0, n = pick(1, 8); i < n; ++i) {
      const WorkloadRequest r{i, pick(1, 80), pick(0, 20)};
      s.add(r);
      total[i] = int64_t(r.prompt_len) + r.gen_len;
    }
    std::set<int64_t> finished, failed;
    int steps = 0;
    while (!s.done()) {
      ASSERT_LT(++steps, 20000) << "trial " << trial << " does not end";
      const ScheduledStep st = s.next_step();
      for (int64_t id : st.admitted) held[id] = 0;
      int64_t used = 0;
      for (const auto& [id, h] : held) used += h;
      std::vector<RunError> rejected;
      for (size_t i = 0; i < st.runs.size(); ++i) {
        const dsv4::Run& r = st.runs[i];
        ASSERT_EQ(r.start_pos, held[r.request]);
        if (used + 2 * r.len > limit) {
          rejected.push_back(cache_full(i));
        } else {
          held[r.request] += r.len;
          used += r.len;
        }
      }
      const StepOutcome out = s.complete(st, rejected);
      stalls += int(rejected.size());
      preemptions += int(out.preempted.size());
      rejected_requests += int(out.failed.size());
      for (int64_t id : out.finished) finished.insert(id), held.erase(id);
      for (int64_t id : out.preempted) held.erase(id);
      for (const auto& f : out.failed) failed.insert(f.request), held.erase(f.request);
    }
    for (const auto& [id, t] : total) {
      EXPECT_EQ(finished.count(id), size_t(t + 1 <= limit)) << "trial " << trial << " request " << id;
      EXPECT_EQ(failed.count(id), size_t(t + 1 > limit)) << "trial " << trial << " request " << id;
    }
  }
  // The trials reach every path: waits, preemptions, rejections.
  EXPECT_GT(stalls, 1000);
  EXPECT_GT(preemptions, 100);
  EXPECT_GT(rejected_requests, 50);
  std::printf("%d stalled runs, %d preemptions, %d requests rejected\n", stalls, preemptions, rejected_requests);
}

namespace {
const std::vector<WorkloadRequest> kMiniRequests = {{0, 300, 4}, {1, 131, 6}, {2, 3, 9}, {3, 260, 2}};

// The mini preset in exact numerics, for `w`'s requests, lengths and steps.
std::unique_ptr<Engine> mini_engine(const CacheWorkload& w, int64_t cache_bytes = INT64_MAX,
                                    int64_t max_positions = 0) {
  ModelConfig c = preset_config("mini");
  if (max_positions > 0) c.max_position_embeddings = max_positions;
  EngineOptions eo;
  eo.profile = Profile::kExact;
  eo.cache_bytes = cache_bytes;
  eo.workload = w;
  return Engine::from_seed(c, 1, eo);
}

WorkloadReport run_mini(int budget, uint64_t seed = 5, int64_t cache_bytes = INT64_MAX) {
  auto engine = mini_engine(CacheWorkload{4, 400, budget}, cache_bytes);
  Scheduler sched(SchedulerOptions{budget, 4});
  return run_workload(*engine, sched, kMiniRequests, seed);
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

// Quantiles from 1%-wide buckets: within 1% of the sorted samples'; the
// mean and the largest exact; nothing below zero.
TEST(Latency, HistogramQuantilesAreWithinOnePercent) {
  DurationHistogram h;
  EXPECT_EQ(h.quantile(0.5), 0.0);
  std::vector<double> v;
  std::mt19937 rng(3);
  std::lognormal_distribution<double> d(std::log(0.02), 1.5);  // 20 ms typical, a long tail
  double sum = 0;
  for (int i = 0; i < 20000; ++i) v.push_back(d(rng)), h.add(v.back()), sum += v.back();
  std::sort(v.begin(), v.end());
  for (double q : {0.01, 0.5, 0.9, 0.99, 1.0}) {
    const double want = v[size_t(std::ceil(q * double(v.size()))) - 1];
    EXPECT_NEAR(h.quantile(q), want, 0.01 * want) << "q " << q;
  }
  EXPECT_EQ(h.count(), 20000);
  EXPECT_NEAR(h.mean(), sum / 20000, 1e-12 * sum);
  EXPECT_EQ(h.max(), v.back());
  DurationHistogram z;
  z.add(-1.0), z.add(0.0), z.add(1e-9);
  EXPECT_EQ(z.count(), 3);
  EXPECT_LE(z.quantile(1.0), 1e-9);
  EXPECT_GE(z.quantile(0.5), 0.0);
}

// The cache a tight run gets: 30% of what the ample run peaked at (with
// 40% requests stall but none is preempted; with 25% some can never fit).
int64_t tight_cache(const WorkloadReport& ample) { return int64_t(ample.peak_cache_total * 3 / 10); }

// With a tight cache requests stall, the youngest are preempted and
// computed again from position 0: every request is served and every token
// ends as it would have (the exact profile is schedule-free).
TEST(Workload, PreemptedRequestsComputeTheSameTokensAgain) {
  const WorkloadReport ample = run_mini(512);
  EXPECT_EQ(ample.stalled_runs, 0);
  EXPECT_EQ(ample.preemptions, 0);
  const int64_t limit = tight_cache(ample);
  const WorkloadReport tight = run_mini(512, 5, limit);
  EXPECT_EQ(tight.finished, 4);
  EXPECT_TRUE(tight.errors.empty()) << tight.errors.front();
  EXPECT_GT(tight.stalled_runs, 0);
  EXPECT_GT(tight.preemptions, 0);
  EXPECT_GT(tight.recomputed_tokens, 0);
  EXPECT_LE(int64_t(tight.peak_cache_total), limit);
  EXPECT_EQ(tight.prefill_tokens + tight.decode_tokens,
            ample.prefill_tokens + ample.decode_tokens + tight.recomputed_tokens);
  EXPECT_NEAR(tight.checksum, ample.checksum, 1e-7 * ample.checksum);
  EXPECT_EQ(tight.nonfinite_values, 0);
}

// A request's first token comes when its prompt ends and one more with
// each decode step: as many timed tokens as requests and decode steps, with
// or without preemptions (the tokens a preempted request computes again were
// already sent).
TEST(Workload, EveryTokenIsTimedOnceEvenWhenComputedAgain) {
  const WorkloadReport ample = run_mini(512);
  const WorkloadReport tight = run_mini(512, 5, tight_cache(ample));
  ASSERT_GT(tight.recomputed_tokens, 0);
  for (const WorkloadReport* r : {&ample, &tight}) {
    EXPECT_EQ(r->first_token.count, 4);
    EXPECT_EQ(r->between_tokens.count, 4 + 6 + 9 + 2);
    EXPECT_GT(r->first_token.median, 0.0);
    EXPECT_LE(r->first_token.median, r->first_token.p99 * 1.011);
    EXPECT_LE(r->first_token.max, r->total_seconds);
    EXPECT_GT(r->between_tokens.median, 0.0);
    EXPECT_LE(r->between_tokens.max, r->total_seconds);
  }
}

// Where even one token a step cannot fit a request, that request is
// rejected with the reason, before any of its work, and the others are served.
TEST(Workload, ARequestThatCannotFitAloneIsRejectedAndTheOthersServed) {
  const WorkloadReport ample = run_mini(512);
  const WorkloadReport r = run_mini(512, 5, int64_t(ample.peak_cache_total / 5));
  EXPECT_GE(r.finished, 1);
  EXPECT_FALSE(r.errors.empty());
  EXPECT_EQ(r.finished + int(r.errors.size()), 4);
  // Rejected before their first step: every token computed belongs to a served request.
  int64_t served = 0;
  for (const WorkloadRequest& q : kMiniRequests) {
    bool rejected = false;
    for (const std::string& e : r.errors) rejected |= e.rfind("request " + std::to_string(q.id) + ": ", 0) == 0;
    if (!rejected) served += q.prompt_len + q.gen_len;
  }
  EXPECT_EQ(r.prefill_tokens + r.decode_tokens - r.recomputed_tokens, served);
  for (const std::string& e : r.errors) EXPECT_NE(e.find("it cannot fit"), std::string::npos) << e;
}

// The requests are made as the scheduler has room for them: a workload of
// any size holds a few at once (2^31 requests in a vector and a queue were about 70 GB).
TEST(Workload, RequestsAreMadeAsTheSchedulerTakesThem) {
  auto engine = mini_engine(CacheWorkload{4, 2, 6});
  Scheduler sched(SchedulerOptions{6, 4});
  int64_t made = 0, ended = 0, most_held = 0;  // held: made, not yet finished
  const WorkloadSource source{2000, [&](int64_t i) {
                                most_held = std::max(most_held, ++made - ended);
                                return WorkloadRequest{i, 1 + int(i % 2), 0};
                              }};
  const WorkloadReport r = run_workload(*engine, sched, source, 5, [&](const StepProgress& p) {
    EXPECT_EQ(p.requests_total, 2000);
    ended = p.requests_ended;
  });
  EXPECT_EQ(r.finished, 2000);
  EXPECT_EQ(made, 2000);
  EXPECT_EQ(r.prefill_tokens, 3000);
  EXPECT_LE(most_held, 4 + 4);  // running, and a queue of what one step may admit
  EXPECT_GE(most_held, 4);
}

// Requests come at their arrival: at no step are more of them running or
// ended than have arrived (by this test's clock, which started first, so a
// slow machine only loosens the bound), the run lasts past the last arrival,
// and each first token is timed from its own request's arrival (from the
// run's start, the last one's would be at least 0.8 s; it takes a step or two).
TEST(Workload, RequestsComeAtTheirArrival) {
  auto engine = mini_engine(CacheWorkload{4, 8, 64});
  Scheduler sched(SchedulerOptions{64, 4});
  const std::vector<WorkloadRequest> reqs = {{0, 3, 2, 0.0}, {1, 5, 2, 0.4}, {2, 4, 2, 0.8}};
  const auto t0 = std::chrono::steady_clock::now();
  int early = 0;
  const WorkloadReport r = run_workload(*engine, sched, reqs, 5, [&](const StepProgress& p) {
    const double now = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    const int64_t arrived = std::count_if(reqs.begin(), reqs.end(), [&](const auto& q) { return q.arrival <= now; });
    early += p.requests_ended + int64_t(p.running) > arrived;
  });
  EXPECT_EQ(early, 0) << "steps with requests taken before they arrived";
  EXPECT_EQ(r.finished, 3);
  EXPECT_GE(r.total_seconds, 0.8);
  EXPECT_EQ(r.first_token.count, 3);
  EXPECT_LT(r.first_token.max, 0.8) << "timed from the run's start?";
  EXPECT_EQ(r.between_tokens.count, 6);
}

// Poisson gaps: a mean of 1 / rate, the same for the same (seed, i).
TEST(Workload, PoissonGapsHaveTheRatesMean) {
  double sum = 0;
  for (int i = 0; i < 40000; ++i) {
    const double g = poisson_gap(9, i, 50.0);
    ASSERT_GE(g, 0.0);
    sum += g;
  }
  EXPECT_NEAR(sum / 40000, 1.0 / 50, 0.02 / 50);
  EXPECT_EQ(poisson_gap(9, 17, 50.0), poisson_gap(9, 17, 50.0));
  EXPECT_NE(poisson_gap(9, 17, 50.0), poisson_gap(10, 17, 50.0));
}

// Every rejected request is counted; the reasons of the first few are kept.
TEST(Workload, ManyRejectedRequestsKeepTheFirstReasons) {
  auto engine = mini_engine(CacheWorkload{2, 64, 64}, INT64_MAX, 64);
  Scheduler sched(SchedulerOptions{64, 2});
  std::vector<WorkloadRequest> reqs;
  for (int i = 0; i < 50; ++i) reqs.push_back({i, 60 + i % 10, 5});  // past 64 from 60 + 5
  const WorkloadReport r = run_workload(*engine, sched, reqs, 5);
  EXPECT_EQ(r.steps, 0);
  EXPECT_EQ(r.finished, 0);
  EXPECT_EQ(r.rejected, 50);
  ASSERT_EQ(r.errors.size(), WorkloadReport::kReasonsKept);
  EXPECT_EQ(r.errors[0].rfind("request 0: a prompt of 60 tokens and 5 generated", 0), 0u) << r.errors[0];
  EXPECT_EQ(r.errors.back().rfind("request 31: ", 0), 0u) << r.errors.back();
}

// A request whose last position is past the model's is rejected before any
// step computes a token of it (the step's own check would reject it only
// once its prefill got there); one that ends exactly at the limit is served.
TEST(Workload, ARequestPastTheModelsPositionsIsRejectedBeforeItsFirstStep) {
  auto engine = mini_engine(CacheWorkload{3, 320, 64}, INT64_MAX, 320);
  Scheduler sched(SchedulerOptions{64, 3});
  const std::vector<WorkloadRequest> reqs = {{0, 316, 4}, {1, 300, 21}, {2, 20, 3}};
  const WorkloadReport r = run_workload(*engine, sched, reqs, 5);
  EXPECT_EQ(r.finished, 2);
  ASSERT_EQ(r.errors.size(), 1u);
  EXPECT_NE(r.errors[0].find("request 1: a prompt of 300 tokens and 21 generated need positions up to 320, "
                             "past max_position_embeddings (320)"),
            std::string::npos)
      << r.errors[0];
  EXPECT_EQ(r.prefill_tokens, 316 + 20);  // none of request 1's
  EXPECT_EQ(r.decode_tokens, 4 + 3);
}
