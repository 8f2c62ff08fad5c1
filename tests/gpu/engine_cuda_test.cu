// The engine end to end on the GPU (issue #12): the golden replay on the
// CUDA backend, the CUDA backend against the CPU backend on a small preset
// (outputs within production bounds, top-k sets), and decode steps replayed
// from CUDA graphs against the same steps run eagerly (bitwise).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>
#include <string>
#include <set>
#include <vector>

#include "common/error.h"
#include "runtime/engine.h"
#include "runtime/golden_replay.h"
#include "runtime/workload.h"
#include "support/cuda_device.h"

using namespace dsv4;

namespace {

class EngineCudaTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!have_cuda_device()) GTEST_SKIP() << "no CUDA device";
  }
};

double rel_l2(std::span<const float> a, std::span<const float> b) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    num += (double(a[i]) - b[i]) * (double(a[i]) - b[i]);
    den += double(b[i]) * b[i];
  }
  return std::sqrt(num / std::max(den, 1e-30));
}

double percentile(std::vector<double> v, double p) {
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, size_t(p * double(v.size() - 1) + 0.5))];
}

std::unique_ptr<Engine> small_engine(Device d, bool graphs = true, bool lanes = true,
                                     int64_t lanes_max_tokens = EngineOptions{}.cuda_lanes_max_tokens,
                                     bool short_select = true) {
  EngineOptions o;
  o.device = d;
  o.cuda_graphs = graphs;
  o.cuda_short_select = short_select;
  o.cuda_lanes = lanes;
  o.cuda_lanes_max_tokens = lanes_max_tokens;
  o.workload = CacheWorkload{4, 2048, 512};
  o.gpu_memory = 0.5;
  return Engine::from_seed(preset_config("small"), 11, o);
}

std::vector<float> inputs(const StepMetadata& s, int D) {
  std::vector<float> x(size_t(s.num_tokens()) * D);
  for (int t = 0; t < s.num_tokens(); ++t)
    synthetic_embedding(5, s.runs[size_t(s.token_run()[size_t(t)])].request, s.positions()[size_t(t)], D,
                        x.data() + size_t(t) * D);
  return x;
}

// Prefill chunks (one ending inside a compression block), then decodes,
// then steps of 40, 18 and 8 tokens (the FP8 linears' GEMM tiles of 64, 32
// and 8 tokens, the last with wq_b's q-head tail) and a decode after them.
std::vector<std::vector<dsv4::Run>> schedule() {
  return {{{0, 0, 300}, {1, 0, 77}},
          {{0, 300, 213}, {1, 77, 1}, {2, 0, 5}},
          {{0, 513, 1}, {1, 78, 1}, {2, 5, 1}},
          {{0, 514, 1}, {1, 79, 1}, {2, 6, 1}},
          {{0, 515, 1}, {1, 80, 1}, {2, 7, 1}},
          {{0, 516, 1}, {1, 81, 1}},
          {{0, 517, 1}, {1, 82, 1}, {2, 8, 38}},
          {{1, 83, 1}, {2, 46, 17}},
          {{0, 518, 1}, {1, 84, 1}, {2, 63, 6}},
          {{0, 519, 1}, {1, 85, 1}, {2, 69, 1}}};
}

}  // namespace

TEST_F(EngineCudaTest, GoldenMiniFp8PassesOnTheGpu) {
  const GoldenCase gc = load_golden_case(DSV4_GOLDEN_DIR, "mini-fp8");
  ReplayOptions o{Profile::kProduction};
  o.device = Device::kCuda;
  const ReplayResult r = replay_golden(gc, o);
  const MetricSummary out = summarize(r.metrics, "output"), kv = summarize(r.metrics, "kv");
  std::printf("    output median %.3e p90 %.3e max %.3e; kv p99 %.3e; top-k overlap %.5f\n", out.median, out.p90,
              out.max, kv.p99, summarize(r.metrics, "topk").topk_overlap);
  EXPECT_EQ(judge_replay(r, Profile::kProduction), "");
  // The CPU's kv rows equal the golden's bit for bit; the GPU's fp32 sums in
  // another order flip a bf16 rounding now and then, and an FP8 code with it.
  EXPECT_LT(kv.p99, 1e-2);
  // And against the CPU backend's replay of the same case.
  const ReplayResult cpu = replay_golden(gc, ReplayOptions{Profile::kProduction});
  std::vector<double> d;
  for (const auto& [key, y] : r.outputs) d.push_back(rel_l2(y, cpu.outputs.at(key)));
  std::printf("    vs the CPU backend: median %.3e p90 %.3e max %.3e over %zu (call, layer)\n", percentile(d, 0.5),
              percentile(d, 0.9), percentile(d, 1.0), d.size());
  EXPECT_LE(percentile(d, 0.5), 2.5e-2);
  EXPECT_LE(percentile(d, 0.9), 4e-2);
}

TEST_F(EngineCudaTest, MatchesTheCpuBackendOnTheSmallPreset) {
  auto cpu = small_engine(Device::kCpu), gpu = small_engine(Device::kCuda);
  const int D = cpu->config().hidden_size;
  for (int id : {0, 1, 2}) cpu->open_request(id), gpu->open_request(id);
  std::vector<double> dist;
  std::map<std::string, std::vector<double>> by;  // per tensor and layer type
  int64_t picks = 0, shared = 0;
  for (const auto& runs : schedule()) {
    std::vector<RunError> e1, e2;
    const StepMetadata sc = cpu->plan(runs, e1), sg = gpu->plan(runs, e2);
    ASSERT_TRUE(e1.empty() && e2.empty());
    const std::vector<float> x = inputs(sc, D);
    std::vector<std::vector<float>> yc;
    std::vector<LayerCapture> cc;
    cpu->forward_layers(sc, x, true, [&](int, std::span<const float> y, const LayerCapture* c) {
      yc.emplace_back(y.begin(), y.end());
      cc.push_back(*c);
    });
    gpu->forward_layers(sg, x, true, [&](int l, std::span<const float> y, const LayerCapture* c) {
      for (float v : y) ASSERT_TRUE(std::isfinite(v)) << "layer " << l;
      dist.push_back(rel_l2(y, yc[size_t(l)]));
      const std::string type(layer_type_name(cpu->config().layer_type(l)));
      by["output " + type].push_back(dist.back());
      by["kv " + type].push_back(rel_l2(c->kv, cc[size_t(l)].kv));
      by["q " + type].push_back(rel_l2(c->q, cc[size_t(l)].q));
      by["attn " + type].push_back(rel_l2(c->attn, cc[size_t(l)].attn));
      if (!c->compressed.empty() && c->compressed.size() == cc[size_t(l)].compressed.size())
        by["compressed " + type].push_back(rel_l2(c->compressed, cc[size_t(l)].compressed));
      ASSERT_EQ(c->topk.size(), cc[size_t(l)].topk.size());
      for (size_t t = 0; t < c->topk.size(); ++t) {
        const std::set<int32_t> a(c->topk[t].begin(), c->topk[t].end()), b(cc[size_t(l)].topk[t].begin(),
                                                                         cc[size_t(l)].topk[t].end());
        picks += int64_t(std::max(a.size(), b.size()));
        for (int32_t j : a) shared += b.count(j);
      }
    });
    cpu->commit(sc), gpu->commit(sg);
  }
  const double overlap = picks ? double(shared) / double(picks) : 1.0;
  for (const auto& [name, v] : by)
    std::printf("    %-18s median %.3e max %.3e (%zu)\n", name.c_str(), percentile(v, 0.5), percentile(v, 1.0), v.size());
  std::printf("    layer outputs vs CPU: median %.3e p90 %.3e max %.3e over %zu; top-k overlap %.5f of %lld picks\n",
              percentile(dist, 0.5), percentile(dist, 0.9), percentile(dist, 1.0), dist.size(), overlap,
              (long long)picks);
  EXPECT_LE(percentile(dist, 0.5), 2.5e-2);
  EXPECT_LE(percentile(dist, 0.9), 4e-2);
  EXPECT_GE(overlap, 0.99);
  EXPECT_GT(picks, 0);
}

namespace {

// The schedule's steps on both engines give the same bits.
void expect_bitwise_equal_steps(Engine& a, Engine& b) {
  const int D = a.config().hidden_size;
  for (int id : {0, 1, 2}) a.open_request(id), b.open_request(id);
  int step = 0;
  for (const auto& runs : schedule()) {
    std::vector<RunError> e1, e2;
    const StepMetadata sa = a.plan(runs, e1), sb = b.plan(runs, e2);
    const std::vector<float> x = inputs(sa, D);
    std::vector<float> ya(x.size()), yb(x.size());
    a.forward_step(sa, x, ya);
    b.forward_step(sb, x, yb);  // decodes in graphs: 1st eager, 2nd captured, then replayed
    ASSERT_EQ(ya, yb) << "step " << step;
    for (float v : ya) ASSERT_TRUE(std::isfinite(v)) << "step " << step;
    a.commit(sa), b.commit(sb);
    ++step;
  }
}

}  // namespace

TEST_F(EngineCudaTest, GraphReplayIsBitwiseTheEagerStep) {
  auto eager = small_engine(Device::kCuda, false), graphed = small_engine(Device::kCuda, true);
  expect_bitwise_equal_steps(*eager, *graphed);
}

// The lanes only reorder independent kernels: one stream gives the same bits
// (a missing lane dependency would show up as a difference or a NaN), with
// lanes in every step (prefill chunks too) and in the decode steps only.
TEST_F(EngineCudaTest, LanesAreBitwiseOneStream) {
  for (int64_t lanes_max : {int64_t(1) << 30, EngineOptions{}.cuda_lanes_max_tokens}) {
    auto serial = small_engine(Device::kCuda, false, false), laned = small_engine(Device::kCuda, true, true, lanes_max);
    expect_bitwise_equal_steps(*serial, *laned);
  }
}

// The schedule's decode steps (short rows) select in one kernel
// (IndexerSelectCuda::run_short); plan, score and finalize give the same
// bits, eager and graphed.
TEST_F(EngineCudaTest, ShortSelectIsBitwiseTheScoredSteps) {
  for (bool graphs : {false, true}) {
    const int64_t lanes_max = EngineOptions{}.cuda_lanes_max_tokens;
    auto scored = small_engine(Device::kCuda, graphs, true, lanes_max, false);
    auto short_select = small_engine(Device::kCuda, graphs, true, lanes_max, true);
    expect_bitwise_equal_steps(*scored, *short_select);
  }
}

TEST_F(EngineCudaTest, EmptyAndRejectedStepsRunNothing) {
  auto gpu = small_engine(Device::kCuda);
  gpu->open_request(0);
  std::vector<RunError> errors;
  const StepMetadata s = gpu->plan({{0, 5, 3}, {7, 0, 1}}, errors);  // wrong start, unknown request
  EXPECT_EQ(errors.size(), 2u);
  EXPECT_EQ(s.num_tokens(), 0);
  std::vector<float> none;
  gpu->forward_step(s, none, none);
  const StepMetadata ok = gpu->plan({{0, 0, 3}}, errors);
  const std::vector<float> x = inputs(ok, gpu->config().hidden_size);
  std::vector<float> y(x.size());
  gpu->forward_step(ok, x, y);
  for (float v : y) ASSERT_TRUE(std::isfinite(v));
}

// The attention's decode-kernel limits reach the backend: an entry limit
// past what the kernel takes is refused by name before any step runs.
TEST_F(EngineCudaTest, RejectsDecodeAttentionLimitsPastTheKernel) {
  EngineOptions o;
  o.device = Device::kCuda;
  o.workload = CacheWorkload{4, 2048, 512};
  o.gpu_memory = 0.5;
  o.cuda_attention_decode_max_entries = 4096;  // the kernel takes rows of up to 1,024
  try {
    Engine::from_seed(preset_config("small"), 11, o);
    ADD_FAILURE() << "an entry limit past the decode kernel was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("decode_max_entries"), std::string::npos) << e.what();
  }
}

namespace {

struct Served {
  WorkloadReport report;
  int64_t arenas = 0;  // the device caches' bytes
  int64_t fixed = 0;   // of which the SWA and compressor-state pages the workload keeps
};

Served serve_small(int64_t cache_bytes) {
  EngineOptions o;
  o.device = Device::kCuda;
  o.workload = CacheWorkload{4, 2048, 512};
  o.gpu_memory = 0.5;
  o.cache_bytes = cache_bytes;
  auto engine = Engine::from_seed(preset_config("small"), 11, o);
  Served s;
  s.arenas = engine->backend().memory().caches;
  const CacheLimits l = engine->blocks().limits();
  for (CacheGroup g : kAllCacheGroups)
    if (g != CacheGroup::kC4A && g != CacheGroup::kC128A) s.fixed += int64_t(l[g]) * engine->cache_spec().group(g).page_bytes;
  Scheduler sched(SchedulerOptions{512, 4});
  const std::vector<WorkloadRequest> reqs = {{0, 900, 4}, {1, 413, 6}, {2, 3, 9}, {3, 700, 2}};
  s.report = run_workload(*engine, sched, reqs, 5);
  return s;
}

}  // namespace

// --cache-memory on the GPU: the device arenas hold no more than it. With the
// fixed pages and half the compressed pages an ample run peaked at, runs
// wait, the youngest requests are preempted and computed again, every
// request is served, and the result is the ample run's up to the production
// numerics' roundings (the recomputed tokens run in other batches, so on
// other kernel paths).
TEST_F(EngineCudaTest, TightDeviceCachesPreemptAndServeEveryRequest) {
  const Served ample = serve_small(INT64_MAX);
  const WorkloadReport& a = ample.report;
  ASSERT_EQ(a.finished, 4);
  EXPECT_EQ(a.preemptions, 0);
  const int64_t limit = ample.fixed + int64_t(a.peak_group_bytes[size_t(CacheGroup::kC4A)] +
                                              a.peak_group_bytes[size_t(CacheGroup::kC128A)]) / 2;
  const Served tight = serve_small(limit);
  const WorkloadReport& t = tight.report;
  std::printf("    ample: arenas %lld B, peak %zu B, checksum %.7f; tight: limit %lld B, arenas %lld B, %lld stalled "
              "runs, %d preemptions, %lld tokens again, checksum %.7f\n",
              (long long)ample.arenas, a.peak_cache_total, a.checksum, (long long)limit, (long long)tight.arenas,
              (long long)t.stalled_runs, t.preemptions, (long long)t.recomputed_tokens, t.checksum);
  EXPECT_LE(tight.arenas, limit);
  EXPECT_EQ(t.finished, 4);
  EXPECT_TRUE(t.errors.empty()) << t.errors.front();
  EXPECT_GT(t.stalled_runs, 0);
  EXPECT_GT(t.preemptions, 0);
  EXPECT_EQ(t.prefill_tokens + t.decode_tokens, a.prefill_tokens + a.decode_tokens + t.recomputed_tokens);
  EXPECT_EQ(t.nonfinite_values, 0);
  EXPECT_NEAR(t.checksum, a.checksum, 1e-4 * a.checksum);
}
