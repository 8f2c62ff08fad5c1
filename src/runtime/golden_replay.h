#pragma once
// Replays a golden case (SPEC §10) through the engine, batching the requests'
// calls as a scheduler would, and measures every layer's intermediate tensors
// against the recorded ones.
#include <cstdint>
#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include "attn/profile.h"
#include "cache/index_key_format.h"
#include "model/config.h"
#include "runtime/engine.h"

namespace dsv4 {

struct GoldenCall {
  int64_t start_pos = 0;
  int len = 0;
};

struct GoldenCase {
  std::string name;
  std::filesystem::path dir;
  ModelConfig config;
  std::vector<std::vector<GoldenCall>> requests;  // calls per request
};

// Reads <dir>/<name>.json; throws Error naming what is missing or malformed.
GoldenCase load_golden_case(const std::filesystem::path& dir, const std::string& name);

struct ReplayOptions {
  Profile profile = Profile::kProduction;
  IndexKeyFormat index_keys = IndexKeyFormat::kMxfp4;
  // Split every call into runs of at most this many tokens (0: whole calls).
  int max_chunk = 0;
  // Lockstep: each step takes the next run of every request (a batch that
  // mixes prefill and decode). Otherwise one request at a time.
  bool lockstep = true;
  Device device = Device::kCpu;
};

// One comparison: relative L2 distance of a tensor, or top-k set overlap.
struct ReplayMetric {
  int request = 0, call = 0, layer = 0;
  std::string tensor;  // output, kv, q, attn, compressed, index_keys, topk
  double value = 0;    // rel. L2 (lower is better) or overlap fraction (topk)
  int64_t count = 0;   // elements or picks compared
};

struct ReplayResult {
  std::vector<ReplayMetric> metrics;
  // The outputs ours produced, per "r<N>.c<K>.l<L>" [S, D], for comparing replays.
  std::map<std::string, std::vector<float>> outputs;
  int steps = 0;
};

ReplayResult replay_golden(const GoldenCase& gc, const ReplayOptions& options);

// Summary of one tensor's metrics.
struct MetricSummary {
  int64_t count = 0;
  double median = 0, p90 = 0, p99 = 0, max = 0;
  double topk_overlap = 1;  // pooled over all picks (topk only)
};
MetricSummary summarize(const std::vector<ReplayMetric>& metrics, const std::string& tensor);

// The acceptance of issue #3: exact profile: every output within 1e-4 and
// every top-k set identical; production: output median <= 2.5e-2, p90 <= 4e-2,
// top-k overlap >= 0.99. Returns an empty string when it passes, else why not.
std::string judge_replay(const ReplayResult& r, Profile profile);

}  // namespace dsv4
