// The golden replays of SPEC §10: both cases within the acceptance of issue
// #3, and batching or chunking that does not change the exact outputs.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <fstream>
#include <functional>
#include <limits>

#include <nlohmann/json.hpp>

#include "model/safetensors.h"
#include "runtime/golden_replay.h"
#include "support/edited_safetensors.h"
#include "support/error_of.h"
#include "support/temp_dir.h"

using namespace dsv4;

namespace {

double max_rel_diff(const ReplayResult& a, const ReplayResult& b) {
  double worst = 0;
  EXPECT_EQ(a.outputs.size(), b.outputs.size());
  for (const auto& [key, va] : a.outputs) {
    const auto it = b.outputs.find(key);
    if (it == b.outputs.end()) return INFINITY;
    double num = 0, den = 0;
    for (size_t i = 0; i < va.size(); ++i) {
      num += std::pow(double(va[i]) - it->second[i], 2);
      den += double(va[i]) * va[i];
    }
    worst = std::max(worst, std::sqrt(num / std::max(den, 1e-30)));
  }
  return worst;
}

}  // namespace

TEST(Golden, MiniExactProfile) {
  const GoldenCase gc = load_golden_case(DSV4_GOLDEN_DIR, "mini");
  const ReplayResult r = replay_golden(gc, ReplayOptions{Profile::kExact});
  EXPECT_EQ(judge_replay(r, Profile::kExact), "");
  EXPECT_EQ(summarize(r.metrics, "output").count, 624);  // every (call, layer) of the 4 requests
  EXPECT_LT(summarize(r.metrics, "compressed").max, 1e-5);
  EXPECT_LT(summarize(r.metrics, "index_keys").max, 1e-5);
  EXPECT_EQ(summarize(r.metrics, "topk").topk_overlap, 1.0);
}

TEST(Golden, MiniFp8ProductionProfile) {
  const GoldenCase gc = load_golden_case(DSV4_GOLDEN_DIR, "mini-fp8");
  const ReplayResult r = replay_golden(gc, ReplayOptions{Profile::kProduction});
  EXPECT_EQ(judge_replay(r, Profile::kProduction), "");
  const MetricSummary out = summarize(r.metrics, "output");
  EXPECT_LE(out.median, 2.5e-2);
  EXPECT_LE(out.p90, 4e-2);
  EXPECT_GE(summarize(r.metrics, "topk").topk_overlap, 0.99);
  // The case leaves out empty entry tensors: absent on both sides, never "inf".
  for (const char* t : {"compressed", "index_keys"}) {
    const MetricSummary e = summarize(r.metrics, t);
    EXPECT_GT(e.count, 0) << t;
    EXPECT_EQ(e.size_mismatches, 0) << t;
    EXPECT_TRUE(std::isfinite(e.max)) << t << " max " << e.max;
  }
  // One FP8 quantization of well-conditioned values: kv rows match almost exactly.
  EXPECT_LT(summarize(r.metrics, "kv").p99, 1e-3);
}

TEST(Golden, ProductionWithFp8IndexerKeysStaysClose) {
  // vLLM's default key format: not what the golden used, so only looser agreement.
  const GoldenCase gc = load_golden_case(DSV4_GOLDEN_DIR, "mini-fp8");
  const ReplayResult r = replay_golden(gc, ReplayOptions{Profile::kProduction, IndexKeyFormat::kFp8});
  EXPECT_LE(summarize(r.metrics, "output").median, 2.5e-2);
  EXPECT_GE(summarize(r.metrics, "topk").topk_overlap, 0.9);
}

TEST(Golden, TheJudgeRejectsTheWrongNumerics) {
  // Exact golden replayed with production numerics: must fail the exact bar.
  const GoldenCase gc = load_golden_case(DSV4_GOLDEN_DIR, "mini");
  const ReplayResult r = replay_golden(gc, ReplayOptions{Profile::kProduction});
  EXPECT_NE(judge_replay(r, Profile::kExact), "");
}

TEST(Golden, BatchingAndChunkingDoNotChangeExactOutputs) {
  const GoldenCase gc = load_golden_case(DSV4_GOLDEN_DIR, "mini");
  const ReplayResult batched = replay_golden(gc, ReplayOptions{Profile::kExact});
  ReplayOptions alone{Profile::kExact};
  alone.lockstep = false;  // one request at a time
  alone.max_chunk = 37;    // prefills cut into 37-token runs, boundaries mid-block
  const ReplayResult chunked = replay_golden(gc, alone);
  EXPECT_EQ(judge_replay(chunked, Profile::kExact), "");
  EXPECT_GT(chunked.steps, batched.steps);
  EXPECT_LE(max_rel_diff(batched, chunked), 1e-5);
  ReplayOptions tiny{Profile::kExact};
  tiny.max_chunk = 1;  // every prefill token its own step, batched with the others
  const ReplayResult one = replay_golden(gc, tiny);
  EXPECT_LE(max_rel_diff(batched, one), 1e-5);
}

TEST(Golden, MissingCaseIsAClearError) {
  try {
    load_golden_case(DSV4_GOLDEN_DIR, "no-such-case");
    FAIL();
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("no-such-case.json"), std::string::npos);
  }
}

// ---- malformed cases: errors naming file, request, call and tensor -------------------------------

namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;
using dsv4::test::error_of;
using dsv4::test::find_tensor;
using dsv4::test::OwnedTensor;
using dsv4::test::rewrite_safetensors;
using dsv4::test::TempDir;

using TensorEdit = std::function<void(int request, std::vector<OwnedTensor>&)>;

// Copies golden case "mini" into `dir` as case "x": its JSON through
// `edit_json`, each request file through `edit_tensors`, the weights through
// `edit_weights` (a request file the JSON has no request for is not copied).
void copy_case(const fs::path& dir, const std::function<void(json&)>& edit_json, const TensorEdit& edit_tensors = {},
               const dsv4::test::TensorListEdit& edit_weights = {}) {
  const fs::path golden(DSV4_GOLDEN_DIR);
  std::ifstream in(golden / "mini.json");
  json j = json::parse(in);
  edit_json(j);
  std::ofstream(dir / "x.json") << j.dump();
  rewrite_safetensors(golden / "mini.weights.safetensors", dir / "x.weights.safetensors", edit_weights);
  for (int r = 0; r < 4; ++r) {
    const std::string suffix = ".r" + std::to_string(r) + ".safetensors";
    rewrite_safetensors(golden / ("mini" + suffix), dir / ("x" + suffix), [&](std::vector<OwnedTensor>& ts) {
      if (edit_tensors) edit_tensors(r, ts);
    });
  }
}

// Element i of an F32 or BF16 tensor (NaN and Inf are the same in both).
void set_float(OwnedTensor& t, size_t i, float v) {
  if (t.dtype == DType::kBF16) {
    uint32_t bits;
    std::memcpy(&bits, &v, 4);
    const uint16_t hi = uint16_t(bits >> 16);
    std::memcpy(t.bytes.data() + 2 * i, &hi, 2);
    return;
  }
  if (t.dtype != DType::kF32) throw std::runtime_error("test bug: " + t.name + " is neither F32 nor BF16");
  std::memcpy(t.bytes.data() + 4 * i, &v, 4);
}

std::string load_error(const std::function<void(json&)>& edit) {
  TempDir dir;
  copy_case(dir.path(), edit);
  return error_of([&] { load_golden_case(dir.path(), "x"); });
}

// The error replaying case "x" (exact profile) raises before any step runs.
std::string replay_error(const std::function<void(json&)>& edit_json, const TensorEdit& edit_tensors = {}) {
  TempDir dir;
  copy_case(dir.path(), edit_json, edit_tensors);
  return error_of([&] {
    const GoldenCase gc = load_golden_case(dir.path(), "x");
    replay_golden(gc, ReplayOptions{Profile::kExact});
  });
}

}  // namespace

TEST(GoldenErrors, MalformedJsonNamesRequestAndCall) {
  struct Case {
    std::function<void(json&)> edit;
    const char* expect;
  };
  const Case cases[] = {
      {[](json& j) { j["requests"][1]["calls"] = json::array(); }, "x.json: requests[1].calls is empty"},
      {[](json& j) { j["requests"][2].erase("calls"); }, "x.json: requests[2]: missing field 'calls'"},
      {[](json& j) { j["requests"][2]["calls"] = 3; }, "requests[2].calls is not an array (got number)"},
      {[](json& j) { j["requests"][0] = 5; }, "requests[0] is not an object (got number)"},
      {[](json& j) { j["requests"][0]["calls"][0] = json::array(); }, "requests[0].calls[0] is not an object"},
      {[](json& j) { j["requests"][0]["calls"][0]["len"] = 520.5; },
       "requests[0].calls[0]: field 'len' must be an exact integer (got 520.5)"},
      {[](json& j) { j["requests"][0]["calls"][0]["len"] = true; },
       "requests[0].calls[0]: field 'len' has the wrong type: expected an integer, got boolean true"},
      {[](json& j) { j["requests"][0]["calls"][0]["len"] = 4294967552ull; },
       "requests[0].calls[0]: field 'len' = 4294967552 is out of range [1, 2147483647]"},
      {[](json& j) { j["requests"][0]["calls"][0]["len"] = 0; }, "field 'len' = 0 is out of range [1, 2147483647]"},
      {[](json& j) { j["requests"][0]["calls"][0]["start_pos"] = -1; },
       "requests[0].calls[0]: field 'start_pos' = -1 is out of range [0, 2147483647]"},
      {[](json& j) { j["requests"][0]["calls"][0].erase("start_pos"); },
       "requests[0].calls[0]: missing field 'start_pos'"},
      {[](json& j) { j["requests"][3]["calls"][2]["start_pos"] = 3; },
       "requests[3].calls[2]: start_pos 3 does not continue the request (expected 2)"},
      {[](json& j) { j["config"]["max_position_embeddings"] = 500; },
       "requests[0].calls[0]: positions up to 519 exceed max_position_embeddings (500)"},
      {[](json& j) { j["config"]["hidden_size"] = 256.5; }, "x.json: config: field 'hidden_size' must be an exact integer"},
      {[](json& j) { j.erase("config"); }, "x.json: missing field 'config'"},
      {[](json& j) { j["requests"] = json::object(); }, "x.json: field 'requests' is not an array (got object)"},
      {[](json& j) { j["requests"] = json::array(); }, "x.json: field 'requests' is empty"},
      {[](json& j) { j = json::array(); }, "x.json: expected a JSON object (got array)"},
  };
  for (const Case& c : cases) EXPECT_MENTIONS(load_error(c.edit), c.expect);
  // A number beyond a double, in the text itself: an error naming its place.
  TempDir dir;
  std::ifstream in(std::string(DSV4_GOLDEN_DIR) + "/mini.json");
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const size_t at = text.find("\"len\": 520");
  ASSERT_NE(at, std::string::npos);
  std::ofstream(dir / "x.json") << text.replace(at, 11, "\"len\": 1e999");
  const std::string e = error_of([&] { load_golden_case(dir.path(), "x"); });
  EXPECT_MENTIONS(e, "invalid JSON at 'requests[0].calls[0].len'");
}

TEST(GoldenErrors, TensorFilesAreCheckedBeforeReplay) {
  auto none = [](json&) {};
  // A call longer than its recorded input (the last call: the request stays contiguous).
  EXPECT_MENTIONS(replay_error([](json& j) { j["requests"][2]["calls"][8]["len"] = 2; }),
                  "x.r2.safetensors: request 2, call 8: tensor 'input.r2.c8' has shape [1, 256]; expected [2, 256]");
  // A longer first call, the others shifted: the input has fewer rows than len.
  EXPECT_MENTIONS(replay_error([](json& j) {
                    auto& calls = j["requests"][2]["calls"];
                    calls[0]["len"] = 4;
                    for (size_t k = 1; k < calls.size(); ++k) calls[k]["start_pos"] = calls[k]["start_pos"].get<int>() + 1;
                  }),
                  "request 2, call 0: tensor 'input.r2.c0' has shape [3, 256]; expected [4, 256]");
  // A request with no file.
  EXPECT_MENTIONS(replay_error([](json& j) { j["requests"].push_back(j["requests"][2]); }),
                  "golden case x: the file of request 4, ");
  EXPECT_MENTIONS(replay_error([](json& j) { j["requests"].push_back(j["requests"][2]); }), "x.r4.safetensors, does not exist");
  struct Case {
    TensorEdit edit;
    const char* expect;
  };
  const Case cases[] = {
      {[](int r, auto& ts) { if (r == 1) std::erase_if(ts, [](auto& t) { return t.name == "output.r1.c2.l0"; }); },
       "x.r1.safetensors: request 1, call 2, layer 0: tensor 'output.r1.c2.l0' is missing"},
      {[](int r, auto& ts) { if (r == 0) std::erase_if(ts, [](auto& t) { return t.name == "input.r0.c5"; }); },
       "request 0, call 5: tensor 'input.r0.c5' is missing"},
      {[](int r, auto& ts) { if (r == 0) find_tensor(ts, "kv.r0.c1.l1").shape = {2, 256}; },
       "request 0, call 1, layer 1: tensor 'kv.r0.c1.l1' has shape [2, 256]; expected [1, 512]"},
      {[](int r, auto& ts) { if (r == 0) find_tensor(ts, "q.r0.c1.l1").shape = {1, 2048}; },
       "tensor 'q.r0.c1.l1' has shape [1, 2048]; expected [1, 4, 512]"},
      {[](int r, auto& ts) { if (r == 0) find_tensor(ts, "input.r0.c1").dtype = DType::kI32; },
       "tensor 'input.r0.c1' is I32; expected F32 or BF16"},
      {[](int r, auto& ts) { if (r == 0) find_tensor(ts, "topk.r0.c1.l1").dtype = DType::kF32; },
       "tensor 'topk.r0.c1.l1' is F32; expected I32"},
      {[](int r, auto& ts) { if (r == 0) find_tensor(ts, "topk.r0.c1.l1").shape = {2, 32}; },
       "tensor 'topk.r0.c1.l1' has shape [2, 32]; expected [1, k] with k <= index_topk (64)"},
      {[](int r, auto& ts) { if (r == 0) find_tensor(ts, "topk.r0.c0.l1").shape = {260, 128}; },
       "expected [520, k] with k <= index_topk (64)"},
      {[](int r, auto& ts) { if (r == 0) find_tensor(ts, "compressed.r0.c0.l1").shape = {65, 1024}; },
       "request 0, call 0, layer 1: tensor 'compressed.r0.c0.l1' has shape [65, 1024]; expected [130, 512]"},
      {[](int r, auto& ts) { if (r == 0) find_tensor(ts, "compressed.r0.c0.l2").shape = {2, 1024}; },
       "tensor 'compressed.r0.c0.l2' has shape [2, 1024]; expected [4, 512]"},
      {[](int r, auto& ts) { if (r == 0) std::erase_if(ts, [](auto& t) { return t.name == "index_keys.r0.c0.l1"; }); },
       "tensor 'index_keys.r0.c0.l1' is missing: the call completes 130 entries"},
  };
  for (const Case& c : cases) EXPECT_MENTIONS(replay_error(none, c.edit), c.expect);
  // A request file that is a directory.
  TempDir dir;
  copy_case(dir.path(), none);
  fs::remove(dir / "x.r1.safetensors");
  fs::create_directory(dir / "x.r1.safetensors");
  const GoldenCase gc = load_golden_case(dir.path(), "x");
  EXPECT_MENTIONS(error_of([&] { replay_golden(gc, ReplayOptions{Profile::kExact}); }), "x.r1.safetensors, is a directory");
}

// ---- verdicts: NaN fails, absence is not a distance ---------------------------------------------

TEST(GoldenVerdicts, NonFiniteReferenceValuesFail) {
  TempDir dir;
  copy_case(dir.path(), [](json&) {}, [](int r, std::vector<OwnedTensor>& ts) {
    if (r != 1) return;
    set_float(find_tensor(ts, "output.r1.c0.l0"), 5, std::numeric_limits<float>::quiet_NaN());
    set_float(find_tensor(ts, "kv.r1.c3.l2"), 7, std::numeric_limits<float>::infinity());
  });
  const ReplayResult r = replay_golden(load_golden_case(dir.path(), "x"), ReplayOptions{Profile::kExact});
  const std::string why = judge_replay(r, Profile::kExact);
  EXPECT_MENTIONS(why, "2 values were not finite");
  EXPECT_MENTIONS(why, "kv 1, output 1");
  const MetricSummary out = summarize(r.metrics, "output");
  EXPECT_EQ(out.nonfinite_values, 1);
  EXPECT_EQ(out.count, 624);
  EXPECT_EQ(out.compared, 623);  // the NaN one is left out of the percentiles...
  EXPECT_TRUE(std::isfinite(out.median) && std::isfinite(out.max)) << out.median << " " << out.max;
  EXPECT_LT(out.max, 1e-4);  // ...which stay those of the other outputs
  EXPECT_EQ(summarize(r.metrics, "kv").nonfinite_values, 1);
}

TEST(GoldenVerdicts, NonFiniteOutputsOfOursFail) {
  // layer 2's kv_norm holds a NaN: every kv, attn and output of layer 2 is NaN.
  TempDir dir;
  copy_case(dir.path(), [](json&) {}, {}, [](std::vector<OwnedTensor>& ts) {
    set_float(find_tensor(ts, "layers.2.attn.kv_norm.weight"), 3, std::numeric_limits<float>::quiet_NaN());
  });
  const GoldenCase gc = load_golden_case(dir.path(), "x");
  const ReplayResult r = replay_golden(gc, ReplayOptions{Profile::kExact});
  const std::string why = judge_replay(r, Profile::kExact);
  EXPECT_MENTIONS(why, "values were not finite");
  EXPECT_MENTIONS(why, "first in output r0 c0 l2");
  int64_t tokens = 0;
  for (const auto& calls : gc.requests) tokens += calls.back().start_pos + calls.back().len;
  const MetricSummary out = summarize(r.metrics, "output");
  EXPECT_EQ(out.nonfinite_values, tokens * 256) << "every output value of layer 2";
  EXPECT_EQ(summarize(r.metrics, "kv").nonfinite_values, tokens) << "dim 3 of every kv row of layer 2";
  EXPECT_EQ(out.compared, 416);  // layers 0 and 1
  EXPECT_LT(out.max, 1e-4);
  EXPECT_TRUE(std::isfinite(out.median));
}

TEST(GoldenVerdicts, TensorsTheGoldenDoesNotHoldAreAbsent) {
  TempDir dir;
  copy_case(dir.path(), [](json&) {}, [](int, std::vector<OwnedTensor>& ts) {
    std::erase_if(ts, [](const OwnedTensor& t) { return t.name.starts_with("compressed.") || t.name.starts_with("index_keys."); });
  });
  const ReplayResult r = replay_golden(load_golden_case(dir.path(), "x"), ReplayOptions{Profile::kExact});
  EXPECT_EQ(judge_replay(r, Profile::kExact), "");
  EXPECT_EQ(summarize(r.metrics, "compressed").count, 0);
  EXPECT_EQ(summarize(r.metrics, "index_keys").count, 0);
  for (const ReplayMetric& m : r.metrics) ASSERT_TRUE(std::isfinite(m.value)) << m.tensor << " r" << m.request << " c" << m.call << " l" << m.layer;
  EXPECT_EQ(summarize(r.metrics, "output").count, 624);
}

TEST(GoldenVerdicts, JudgeAndSummaryOnNonFiniteAndMismatchedMetrics) {
  auto metric = [](const char* tensor, double value, int64_t nonfinite = 0, bool mismatch = false) {
    ReplayMetric m{0, 1, 2, tensor, value, 10};
    m.nonfinite = nonfinite;
    m.size_mismatch = mismatch;
    m.ours_count = mismatch ? 20 : 10;
    return m;
  };
  const double nan = std::numeric_limits<double>::quiet_NaN(), inf = std::numeric_limits<double>::infinity();
  std::vector<ReplayMetric> ms = {metric("output", 3e-6), metric("output", nan, 4), metric("output", 1e-6),
                                  metric("output", 2e-6)};
  MetricSummary s = summarize(ms, "output");
  EXPECT_EQ(s.count, 4);
  EXPECT_EQ(s.compared, 3);
  EXPECT_EQ(s.median, 2e-6);
  EXPECT_EQ(s.max, 3e-6);
  EXPECT_EQ(s.nonfinite_values, 4);
  ReplayResult r;
  r.metrics = ms;
  EXPECT_MENTIONS(judge_replay(r, Profile::kExact), "4 values were not finite");
  EXPECT_MENTIONS(judge_replay(r, Profile::kProduction), "first in output r0 c1 l2");
  // Only NaN: no percentiles at all, still a FAIL.
  r.metrics = {metric("output", nan, 1)};
  s = summarize(r.metrics, "output");
  EXPECT_EQ(s.compared, 0);
  EXPECT_TRUE(std::isnan(s.median));
  EXPECT_NE(judge_replay(r, Profile::kProduction), "");
  // Sizes that differ fail even where the tensor is not judged otherwise.
  r.metrics = {metric("output", 0), metric("compressed", inf, 0, true)};
  EXPECT_MENTIONS(judge_replay(r, Profile::kProduction), "1 tensors differ in size from the reference; first compressed r0 c1 l2: ours 20 values");
  r.metrics = {metric("output", 0), metric("kv", 1e-7)};
  EXPECT_EQ(judge_replay(r, Profile::kExact), "");
  r.metrics = {metric("kv", 1e-7)};
  EXPECT_EQ(judge_replay(r, Profile::kExact), "no outputs were compared");
}
