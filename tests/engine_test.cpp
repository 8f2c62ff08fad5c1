// A batch with bad runs: each bad run gets a clear error while the other
// requests of the batch produce exactly what they produce alone.
#include <gtest/gtest.h>

#include <random>

#include "runtime/engine.h"

using namespace dsv4;

namespace {

struct Harness {
  ModelConfig c = preset_config("mini");
  std::unique_ptr<Engine> engine;
  explicit Harness(CacheWorkload w, Profile profile = Profile::kProduction) {
    c.max_position_embeddings = 2000;
    EngineOptions eo;
    eo.profile = profile;
    eo.workload = w;
    engine = Engine::from_seed(c, 3, eo);
  }
  // Runs one step; returns the output rows per accepted run and the errors.
  std::vector<std::vector<float>> step(const std::vector<Run>& runs, std::vector<RunError>& errors) {
    const StepMetadata s = engine->plan(runs, errors);
    std::vector<float> x(size_t(s.num_tokens()) * c.hidden_size);
    for (int t = 0; t < s.num_tokens(); ++t) {  // inputs depend on (request, position) only
      std::mt19937 rng(uint32_t(s.runs[size_t(s.token_run()[size_t(t)])].request * 7919 + s.positions()[size_t(t)]));
      std::normal_distribution<float> nd(0, 1);
      for (int d = 0; d < c.hidden_size; ++d) x[size_t(t) * c.hidden_size + d] = nd(rng);
    }
    std::vector<std::vector<float>> out(s.runs.size());
    engine->forward_layers(s, x, false, [&](int, std::span<const float> y, const LayerCapture*) {
      for (size_t r = 0; r < s.runs.size(); ++r)
        out[r].insert(out[r].end(), y.begin() + size_t(s.token_begin(int(r))) * c.hidden_size,
                      y.begin() + size_t(s.token_begin(int(r) + 1)) * c.hidden_size);
    });
    engine->commit(s);
    return out;
  }
};

}  // namespace

TEST(Engine, BadRunsFailAloneAndOthersAreUnaffected) {
  const CacheWorkload cap{3, 700, 700};
  Harness solo(cap), mixed(cap);
  std::vector<RunError> errors;
  solo.engine->open_request(1);
  const auto a1 = solo.step({{1, 0, 300}}, errors);
  const auto a2 = solo.step({{1, 300, 1}}, errors);
  ASSERT_TRUE(errors.empty());

  mixed.engine->open_request(1);
  mixed.engine->open_request(2);
  mixed.engine->open_request(3);
  // Step 1: request 1's prefill beside an unknown request, a zero-length run,
  // and a prompt the caches cannot hold.
  const auto b1 = mixed.step({{42, 0, 5}, {1, 0, 300}, {2, 0, 0}, {3, 0, 2500}}, errors);
  ASSERT_EQ(errors.size(), 3u);
  EXPECT_NE(errors[0].message.find("unknown request 42"), std::string::npos);
  EXPECT_NE(errors[1].message.find("zero-length"), std::string::npos);
  EXPECT_NE(errors[2].message.find("max_position_embeddings"), std::string::npos);
  ASSERT_EQ(b1.size(), 1u);
  EXPECT_EQ(b1[0], a1[0]);
  // Step 2: request 1 decodes beside a run that exhausts the caches.
  errors.clear();
  const auto b2 = mixed.step({{3, 0, 1500}, {1, 300, 1}}, errors);
  ASSERT_EQ(errors.size(), 1u);
  EXPECT_NE(errors[0].message.find("exhausted"), std::string::npos) << errors[0].message;
  ASSERT_EQ(b2.size(), 1u);
  EXPECT_EQ(b2[0], a2[0]);
  // The rejected requests can still go on with runs that fit.
  errors.clear();
  mixed.step({{3, 0, 64}, {2, 0, 4}}, errors);
  EXPECT_TRUE(errors.empty());
}

TEST(Engine, WeightsForTheWrongLayerTypeAreRejected) {
  const ModelConfig c = preset_config("mini");
  std::vector<LayerWeights> w;
  for (int l = 0; l < 3; ++l) w.push_back(random_layer_weights(c, l == 1 ? 2 : l, 1, true));
  EXPECT_THROW(Engine(c, std::move(w), EngineOptions{}), std::runtime_error);
}

TEST(Engine, RecycledPagesLeakNothingFromAnEarlierRequest) {
  // SPEC §9: a prompt shorter than one block must not see stale compressor
  // state. Request 2 runs on pages request 1 filled and gave back, and must
  // produce what it produces on a fresh engine.
  const CacheWorkload cap{1, 600, 600};
  Harness fresh(cap), reused(cap);
  std::vector<RunError> errors;
  reused.engine->open_request(1);
  reused.step({{1, 0, 520}}, errors);
  reused.step({{1, 520, 1}}, errors);
  reused.engine->close_request(1);
  fresh.engine->open_request(2);
  reused.engine->open_request(2);
  for (const dsv4::Run run : {dsv4::Run{2, 0, 3}, dsv4::Run{2, 3, 1}, dsv4::Run{2, 4, 1}, dsv4::Run{2, 5, 130}}) {
    const auto a = fresh.step({run}, errors), b = reused.step({run}, errors);
    ASSERT_TRUE(errors.empty());
    EXPECT_EQ(a, b) << "run at " << run.start_pos;
  }
}

TEST(Engine, ActivationBuffersCarryNothingFromALargerStep) {
  // The CPU backend keeps its activation buffers from step to step
  // (attn/cpu/scratch.h): a short step right after a long one reuses buffers
  // that hold the long step's values past where the short one writes, and
  // must produce what it produces on a fresh engine.
  for (const Profile profile : {Profile::kProduction, Profile::kExact}) {
    const CacheWorkload cap{2, 600, 600};
    Harness fresh(cap, profile), reused(cap, profile);
    std::vector<RunError> errors;
    reused.engine->open_request(1);
    reused.step({{1, 0, 300}}, errors);
    fresh.engine->open_request(2);
    reused.engine->open_request(2);
    for (const dsv4::Run run : {dsv4::Run{2, 0, 5}, dsv4::Run{2, 5, 1}}) {
      const auto a = fresh.step({run}, errors), b = reused.step({run}, errors);
      ASSERT_TRUE(errors.empty());
      EXPECT_EQ(a, b) << profile_name(profile) << ", run at " << run.start_pos;
    }
  }
}
