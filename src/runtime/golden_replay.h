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
  std::string precision;  // the case's "precision" field ("float32" for `mini`), empty when absent
};

// Reads <dir>/<name>.json; throws Error naming what is missing or malformed
// (the file, and the request and call: calls present, non-empty, contiguous
// from 0, start_pos and len exact integers, within max_position_embeddings).
GoldenCase load_golden_case(const std::filesystem::path& dir, const std::string& name);

// The structural checks of a case's tensor files, before anything replays:
// <name>.r<R>.safetensors for every request, holding input.r<R>.c<K> [len, D]
// and output.r<R>.c<K>.l<L> [len, D] for every call and layer, and, where
// present, kv [len, 512], q and attn [len, H, 512], compressed [n, 512] and
// index_keys [n, 128] with n the entries the call completes, topk I32
// [len, k <= index_topk]; F32 or BF16 elsewhere. Throws Error naming the
// file, request, call, layer and tensor.
void validate_golden_case(const GoldenCase& gc);

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
  double value = 0;    // rel. L2 (lower is better) or overlap fraction (topk);
                       // NaN when a value was not finite, +inf when the sizes differ
  int64_t count = 0;   // elements or picks compared (the reference's)
  int64_t nonfinite = 0;       // NaN or Inf values, ours and the reference's together
  bool size_mismatch = false;  // ours and the reference differ in size
  int64_t ours_count = 0;      // elements (topk: rows) ours produced
};

struct ReplayResult {
  std::vector<ReplayMetric> metrics;
  // The outputs ours produced, per "r<N>.c<K>.l<L>" [S, D], for comparing replays.
  std::map<std::string, std::vector<float>> outputs;
  int steps = 0;
};

// Validates the case (validate_golden_case; check_production_dims for the
// production profile), then replays it.
ReplayResult replay_golden(const GoldenCase& gc, const ReplayOptions& options);

// Summary of one tensor's metrics. The percentiles are over the metrics whose
// value is not NaN (NaN sorts nowhere); the non-finite ones are counted.
struct MetricSummary {
  int64_t count = 0;     // metrics of the tensor
  int64_t compared = 0;  // of them, with a value (not NaN): the percentiles' population
  double median = 0, p90 = 0, p99 = 0, max = 0;  // NaN when nothing was compared
  double topk_overlap = 1;  // pooled over all picks (topk only)
  int64_t nonfinite_values = 0;  // NaN/Inf values seen, ours and the references'
  int64_t size_mismatches = 0;
};
MetricSummary summarize(const std::vector<ReplayMetric>& metrics, const std::string& tensor);

// The acceptance of issue #3: exact profile: every output within 1e-4 and
// every top-k set identical; production: output median <= 2.5e-2, p90 <= 4e-2,
// top-k overlap >= 0.99. Before those: any non-finite value (ours or the
// reference's, in any tensor) or any size that differs from the reference
// fails. Returns an empty string when it passes, else why not.
std::string judge_replay(const ReplayResult& r, Profile profile);

}  // namespace dsv4
