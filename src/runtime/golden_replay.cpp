#include "runtime/golden_replay.h"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <cmath>
#include <limits>
#include <memory>
#include <set>

#include <nlohmann/json.hpp>

#include "common/error.h"
#include "model/config_json.h"
#include "model/safetensors.h"
#include "numerics/bf16.h"
#include "runtime/engine.h"

namespace dsv4 {

GoldenCase load_golden_case(const std::filesystem::path& dir, const std::string& name) {
  const auto path = dir / (name + ".json");
  const nlohmann::json j = read_json_file(path);
  DSV4_REQUIRE(j.contains("config") && j.contains("requests"), path.string() + ": needs 'config' and 'requests'");
  GoldenCase gc{name, dir, config_from_json(j.at("config"), path.string()), {}};
  for (const auto& req : j.at("requests")) {
    std::vector<GoldenCall> calls;
    int64_t next = 0;
    for (const auto& c : req.at("calls")) {
      GoldenCall call{c.at("start_pos").get<int64_t>(), c.at("len").get<int>()};
      DSV4_REQUIRE(call.start_pos == next && call.len > 0,
              path.string() + ": request " + std::to_string(gc.requests.size()) + " has a non-contiguous call");
      next += call.len;
      calls.push_back(call);
    }
    gc.requests.push_back(std::move(calls));
  }
  return gc;
}

namespace {

std::vector<float> to_floats(const TensorView& v) {
  std::vector<float> out(size_t(v.numel()));
  const uint8_t* b = v.bytes.data();
  for (size_t i = 0; i < out.size(); ++i) {
    if (v.dtype == DType::kF32) std::memcpy(&out[i], b + 4 * i, 4);
    else if (v.dtype == DType::kBF16) out[i] = bf16_to_float(uint16_t(b[2 * i] | (b[2 * i + 1] << 8)));
    else throw Error("golden tensor '" + v.name + "' has unexpected dtype " + std::string(dtype_name(v.dtype)));
  }
  return out;
}

double rel_l2(const std::vector<float>& ours, const std::vector<float>& ref) {
  if (ours.size() != ref.size()) return std::numeric_limits<double>::infinity();
  double num = 0, den = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    num += (double(ours[i]) - ref[i]) * (double(ours[i]) - ref[i]);
    den += double(ref[i]) * ref[i];
  }
  if (den == 0) return num == 0 ? 0 : std::numeric_limits<double>::infinity();
  return std::sqrt(num / den);
}

// What ours produced for one call of one request, per layer.
struct CallOutputs {
  std::vector<float> output, kv, q, attn, compressed, index_keys;
  std::vector<std::vector<int32_t>> topk;
};

struct Chunk {
  int call = 0;
  int offset = 0;  // within the call
  int len = 0;
};

class Replayer {
 public:
  Replayer(const GoldenCase& gc, const ReplayOptions& opt) : gc_(gc), opt_(opt) {
    const ModelConfig& c = gc.config;
    int64_t longest = 0;
    int step_tokens = 0;
    for (const auto& calls : gc.requests) {
      longest = std::max(longest, calls.back().start_pos + calls.back().len);
      int widest = 0;
      for (const auto& call : calls) widest = std::max(widest, call.len);
      step_tokens += widest;
    }
    EngineOptions eo;
    eo.device = opt.device;
    eo.profile = opt.profile;
    eo.index_keys = opt.index_keys;
    eo.workload = CacheWorkload{int64_t(gc.requests.size()), longest, step_tokens};
    engine_ = Engine::from_checkpoint(c, gc.dir / (gc.name + ".weights.safetensors"), eo);
    for (size_t r = 0; r < gc.requests.size(); ++r) {
      files_.push_back(
          SafetensorsFile::open(gc.dir / (gc.name + ".r" + std::to_string(r) + ".safetensors")));
      engine_->open_request(int64_t(r));
      std::vector<Chunk> chunks;
      for (int k = 0; k < int(gc.requests[r].size()); ++k) {
        const int len = gc.requests[r][size_t(k)].len, step = opt.max_chunk > 0 ? opt.max_chunk : len;
        for (int off = 0; off < len; off += step) chunks.push_back({k, off, std::min(step, len - off)});
      }
      chunks_.push_back(std::move(chunks));
    }
    next_.assign(gc.requests.size(), 0);
  }

  ReplayResult run() {
    while (true) {
      std::vector<std::pair<int, Chunk>> batch;  // (request, chunk)
      for (size_t r = 0; r < chunks_.size(); ++r) {
        if (next_[r] >= chunks_[r].size()) continue;
        batch.emplace_back(int(r), chunks_[r][next_[r]++]);
        if (!opt_.lockstep) break;
      }
      if (batch.empty()) break;
      step(batch);
    }
    return std::move(result_);
  }

 private:
  const TensorView* golden(int r, const std::string& key) const { return files_[size_t(r)]->find(key); }
  static std::string tag(int r, int c, int l) {
    char buf[64];  // snprintf: GCC 12 warns falsely (-Wrestrict) on chained string +
    std::snprintf(buf, sizeof buf, "r%d.c%d.l%d", r, c, l);
    return buf;
  }

  void step(const std::vector<std::pair<int, Chunk>>& batch) {
    const ModelConfig& c = gc_.config;
    const int D = c.hidden_size;
    std::vector<Run> runs;
    std::vector<float> x;
    for (const auto& [r, ch] : batch) {
      const GoldenCall& call = gc_.requests[size_t(r)][size_t(ch.call)];
      runs.push_back({r, call.start_pos + ch.offset, ch.len});
      const std::string key = "input.r" + std::to_string(r) + ".c" + std::to_string(ch.call);
      const TensorView* in = golden(r, key);
      DSV4_REQUIRE(in != nullptr, "golden case " + gc_.name + ": missing tensor '" + key + "'");
      const std::vector<float> all = to_floats(*in);
      x.insert(x.end(), all.begin() + size_t(ch.offset) * D, all.begin() + size_t(ch.offset + ch.len) * D);
    }
    std::vector<RunError> errors;
    const StepMetadata s = engine_->plan(runs, errors);
    DSV4_REQUIRE(errors.empty(), "golden replay: step rejected a run: " + (errors.empty() ? "" : errors[0].message));
    engine_->forward_layers(s, x, true, [&](int l, std::span<const float> y, const LayerCapture* cap) {
      for (size_t i = 0; i < batch.size(); ++i) collect(batch[i].first, batch[i].second, l, s, int(i), y, *cap);
    });
    engine_->commit(s);
    ++result_.steps;
    for (const auto& [r, ch] : batch)
      if (ch.offset + ch.len == gc_.requests[size_t(r)][size_t(ch.call)].len)
        for (int l = 0; l < c.num_layers; ++l) finish(r, ch.call, l);
  }

  // Appends one run's rows of a layer's results to its call's buffers.
  void collect(int r, const Chunk& ch, int l, const StepMetadata& s, int run, std::span<const float> y,
               const LayerCapture& cap) {
    const ModelConfig& c = gc_.config;
    CallOutputs& o = pending_[tag(r, ch.call, l)];
    const size_t t0 = size_t(s.token_begin(run)), t1 = size_t(s.token_begin(run + 1));
    auto append = [&](std::vector<float>& dst, std::span<const float> src, size_t width) {
      dst.insert(dst.end(), src.begin() + t0 * width, src.begin() + t1 * width);
    };
    append(o.output, y, size_t(c.hidden_size));
    append(o.kv, cap.kv, 512);
    append(o.q, cap.q, size_t(c.num_heads) * 512);
    append(o.attn, cap.attn, size_t(c.num_heads) * 512);
    if (!cap.topk.empty())
      o.topk.insert(o.topk.end(), cap.topk.begin() + long(t0), cap.topk.begin() + long(t1));
    auto entries = [&](std::vector<float>& dst, const std::vector<int>& tokens, const std::vector<float>& rows,
                       size_t width) {
      for (size_t i = 0; i < tokens.size(); ++i)
        if (size_t(tokens[i]) >= t0 && size_t(tokens[i]) < t1)
          dst.insert(dst.end(), rows.begin() + i * width, rows.begin() + (i + 1) * width);
    };
    entries(o.compressed, cap.compressed_tokens, cap.compressed, 512);
    entries(o.index_keys, cap.index_key_tokens, cap.index_keys, 128);
  }

  void metric(int r, int call, int l, const std::string& name, const std::vector<float>& ours) {
    const TensorView* ref = golden(r, name + "." + tag(r, call, l));
    if (!ref) {
      // The fp8 case omits empty entry tensors: then ours must be empty too.
      if (name == "compressed" || name == "index_keys")
        result_.metrics.push_back({r, call, l, name, ours.empty() ? 0.0 : INFINITY, 0});
      return;
    }
    const std::vector<float> g = to_floats(*ref);
    result_.metrics.push_back({r, call, l, name, rel_l2(ours, g), int64_t(g.size())});
  }

  void topk_metric(int r, int call, int l, const std::vector<std::vector<int32_t>>& ours) {
    const TensorView* ref = golden(r, "topk." + tag(r, call, l));
    if (!ref) return;
    DSV4_REQUIRE(ref->dtype == DType::kI32 && ref->shape.size() == 2, "golden topk tensor must be I32 [S, k]");
    const int64_t rows = ref->shape[0], k = ref->shape[1];
    int64_t total = 0, matched = 0;
    for (int64_t t = 0; t < rows; ++t) {
      std::set<int32_t> want;
      for (int64_t i = 0; i < k; ++i) {
        int32_t v;
        std::memcpy(&v, ref->bytes.data() + 4 * (t * k + i), 4);
        if (v >= 0) want.insert(v);
      }
      const std::set<int32_t> got = size_t(t) < ours.size() ? std::set<int32_t>(ours[size_t(t)].begin(), ours[size_t(t)].end())
                                                            : std::set<int32_t>{};
      total += int64_t(std::max(want.size(), got.size()));
      for (int32_t v : got) matched += want.count(v);
    }
    result_.metrics.push_back({r, call, l, "topk", total ? double(matched) / double(total) : 1.0, total});
  }

  void finish(int r, int call, int l) {
    const std::string key = tag(r, call, l);
    CallOutputs o = std::move(pending_[key]);
    pending_.erase(key);
    metric(r, call, l, "output", o.output);
    metric(r, call, l, "kv", o.kv);
    metric(r, call, l, "q", o.q);
    metric(r, call, l, "attn", o.attn);
    if (gc_.config.layer_type(l) != LayerType::kSwaOnly) metric(r, call, l, "compressed", o.compressed);
    if (gc_.config.layer_type(l) == LayerType::kC4A) {
      metric(r, call, l, "index_keys", o.index_keys);
      topk_metric(r, call, l, o.topk);
    }
    result_.outputs[key] = std::move(o.output);
  }

  const GoldenCase& gc_;
  ReplayOptions opt_;
  std::unique_ptr<Engine> engine_;
  std::vector<std::unique_ptr<SafetensorsFile>> files_;
  std::vector<std::vector<Chunk>> chunks_;
  std::vector<size_t> next_;
  std::map<std::string, CallOutputs> pending_;
  ReplayResult result_;
};

}  // namespace

ReplayResult replay_golden(const GoldenCase& gc, const ReplayOptions& options) {
  return Replayer(gc, options).run();
}

MetricSummary summarize(const std::vector<ReplayMetric>& metrics, const std::string& tensor) {
  std::vector<double> v;
  MetricSummary s;
  int64_t picks = 0;
  double matched = 0;
  for (const auto& m : metrics) {
    if (m.tensor != tensor) continue;
    v.push_back(m.value);
    picks += m.count;
    matched += m.value * double(m.count);
  }
  s.count = int64_t(v.size());
  if (v.empty()) return s;
  std::sort(v.begin(), v.end());
  auto pct = [&](double p) { return v[std::min(v.size() - 1, size_t(p * double(v.size() - 1) + 0.5))]; };
  s.median = pct(0.5), s.p90 = pct(0.9), s.p99 = pct(0.99), s.max = v.back();
  s.topk_overlap = picks ? matched / double(picks) : 1.0;
  return s;
}

std::string judge_replay(const ReplayResult& r, Profile profile) {
  const MetricSummary out = summarize(r.metrics, "output"), topk = summarize(r.metrics, "topk");
  char buf[256];
  if (out.count == 0) return "no outputs were compared";
  if (profile == Profile::kExact) {
    if (out.max > 1e-4) {
      std::snprintf(buf, sizeof buf, "an output is %.3g away (limit 1e-4)", out.max);
      return buf;
    }
    if (topk.count && topk.topk_overlap < 1.0) {
      std::snprintf(buf, sizeof buf, "top-k sets differ (overlap %.6f, need 1)", topk.topk_overlap);
      return buf;
    }
    return "";
  }
  if (out.median > 2.5e-2 || out.p90 > 4e-2) {
    std::snprintf(buf, sizeof buf, "output median %.3g (limit 2.5e-2), p90 %.3g (limit 4e-2)", out.median, out.p90);
    return buf;
  }
  if (topk.count && topk.topk_overlap < 0.99) {
    std::snprintf(buf, sizeof buf, "top-k overlap %.4f (need 0.99)", topk.topk_overlap);
    return buf;
  }
  return "";
}

}  // namespace dsv4
