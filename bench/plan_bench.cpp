// The host's share of a step: planning (block tables, slots and lists for
// every run, SPEC §7) and commit, for B requests at context C, each adding
// one token (decode) or a prefill chunk of CHUNK tokens a step. A GPU
// step's wall time includes it (step_bench times plan + copies + replay +
// commit). Two rows:
//  * the CPU backend's plan (Engine::plan with the derived lists), whose
//    cache storage grows as the pages do, so a step that grows it shows in
//    the worst time;
//  * the CUDA backend's (the inputs alone: the device derives the lists),
//    on the block manager without a backend.
//   plan_bench [BATCH CONTEXT [STEPS [CHUNK]]]   (default 128 65536 300 1)
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <vector>

#include "common/error.h"
#include "runtime/engine.h"

using namespace dsv4;

namespace {

// Times `step(k)` for k = 0 .. steps-1 and prints the median, mean and worst.
void time_steps(const char* what, int batch, int64_t context, int steps, int chunk,
                const std::function<void(int)>& step) {
  std::vector<double> t;
  for (int k = 0; k < steps; ++k) {
    const auto t0 = std::chrono::steady_clock::now();
    step(k);
    t.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() * 1e6);
  }
  double sum = 0;
  for (double x : t) sum += x;
  std::sort(t.begin(), t.end());
  std::printf("%s, %d requests at %lld tokens, %d steps of %d token%s each: median %.1f us, mean %.1f, worst %.1f\n",
              what, batch, (long long)context, steps, chunk, chunk == 1 ? "" : "s", t[t.size() / 2],
              sum / double(steps), t.back());
}

std::vector<Run> step_runs(int batch, int64_t position, int chunk) {
  std::vector<Run> runs;
  for (int b = 0; b < batch; ++b) runs.push_back({b, position, chunk});
  return runs;
}

}  // namespace

int main(int argc, char** argv) {
  const int batch = argc > 1 ? std::atoi(argv[1]) : 128;
  const int64_t context = argc > 2 ? std::atoll(argv[2]) : 65536;
  const int steps = argc > 3 ? std::atoi(argv[3]) : 300;
  const int chunk = argc > 4 ? std::atoi(argv[4]) : 1;
  if (batch < 1 || context < 1 || steps < 1 || chunk < 1) {
    std::fprintf(stderr, "usage: plan_bench [BATCH CONTEXT [STEPS [CHUNK]]] (positive numbers)\n");
    return 1;
  }
  const int64_t longest = context + int64_t(steps) * chunk;
  // Flash's dimensions, one layer of each type: every cache group, and the
  // plan does not depend on how many layers share a group.
  ModelConfig c = preset_config("flash");
  c.num_layers = 3;
  c.compress_ratios = {0, 4, 128};
  EngineOptions eo;
  eo.device = Device::kCpu;
  eo.workload = CacheWorkload{batch, longest, int64_t(batch) * chunk};
  eo.cache_weights = false;
  try {
    auto e = Engine::from_seed(c, 1, eo);
    for (int b = 0; b < batch; ++b) e->open_request(b), e->fast_forward(b, context);
    time_steps("plan + commit, CPU backend (with the lists)", batch, context, steps, chunk, [&](int k) {
      std::vector<RunError> errors;
      const StepMetadata s = e->plan(step_runs(batch, context + int64_t(k) * chunk, chunk), errors);
      e->commit(s);
      if (!errors.empty()) throw Error(errors[0].message);
    });

    const CacheSpec spec(c, CacheFormats{});
    BlockManager blocks(spec, CacheLimits::for_workload(spec, batch, longest, int64_t(batch) * chunk));
    for (int b = 0; b < batch; ++b) {  // as Engine::fast_forward
      blocks.open_request(b);
      blocks.reserve(b, context - 1, 1);
      blocks.commit(b, context);
    }
    time_steps("plan + commit, CUDA backend (the inputs alone)", batch, context, steps, chunk, [&](int k) {
      std::vector<RunError> errors;
      const StepMetadata s = plan_step(step_runs(batch, context + int64_t(k) * chunk, chunk), c, blocks, errors, false);
      for (const Run& r : s.runs) blocks.commit(r.request, r.start_pos + r.len);
      if (!errors.empty()) throw Error(errors[0].message);
    });
  } catch (const std::exception& ex) {
    std::fprintf(stderr, "plan_bench: %s\n", ex.what());
    return 1;
  }
}
