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
#include "model/files.h"
#include "model/json_reader.h"
#include "model/safetensors.h"
#include "numerics/bf16.h"
#include "runtime/engine.h"

namespace dsv4 {

namespace {

using json = nlohmann::json;

const json& member(const json& j, const char* field, const std::string& where) {
  const auto it = j.find(field);
  DSV4_REQUIRE(it != j.end() && !it->is_null(), where + ": missing field '" + field + "'");
  return *it;
}

// The calls of one request: contiguous from position 0, each at least one token.
std::vector<GoldenCall> read_calls(const json& req, const std::string& where, int64_t max_positions) {
  DSV4_REQUIRE(req.is_object(), where + " is not an object (got " + std::string(req.type_name()) + ")");
  const json& calls = member(req, "calls", where);
  DSV4_REQUIRE(calls.is_array(), where + ".calls is not an array (got " + std::string(calls.type_name()) + ")");
  DSV4_REQUIRE(!calls.empty(), where + ".calls is empty: a request needs at least one call");
  std::vector<GoldenCall> out;
  int64_t next = 0;
  for (size_t k = 0; k < calls.size(); ++k) {
    const std::string at = where + ".calls[" + std::to_string(k) + "]";
    const json& c = calls[k];
    DSV4_REQUIRE(c.is_object(), at + " is not an object (got " + std::string(c.type_name()) + ")");
    GoldenCall call;
    call.start_pos = json_integer(member(c, "start_pos", at), at + ": field 'start_pos'", 0, kMaxPositions);
    call.len = int(json_integer(member(c, "len", at), at + ": field 'len'", 1, std::numeric_limits<int32_t>::max()));
    DSV4_REQUIRE(call.start_pos == next, at + ": start_pos " + std::to_string(call.start_pos) +
                                        " does not continue the request (expected " + std::to_string(next) + ")");
    next += call.len;  // both terms below 2^31: no overflow
    DSV4_REQUIRE(next <= max_positions, at + ": positions up to " + std::to_string(next - 1) +
                                       " exceed max_position_embeddings (" + std::to_string(max_positions) + ")");
    out.push_back(call);
  }
  return out;
}

}  // namespace

GoldenCase load_golden_case(const std::filesystem::path& dir, const std::string& name) {
  const auto path = dir / (name + ".json");
  const std::string origin = path.string();
  const json j = read_json_file(path);
  DSV4_REQUIRE(j.is_object(), origin + ": expected a JSON object (got " + std::string(j.type_name()) + ")");
  const json& config = member(j, "config", origin);
  const json& requests = member(j, "requests", origin);
  DSV4_REQUIRE(requests.is_array(), origin + ": field 'requests' is not an array (got " +
                                   std::string(requests.type_name()) + ")");
  DSV4_REQUIRE(!requests.empty(), origin + ": field 'requests' is empty");
  GoldenCase gc{name, dir, config_from_json(config, origin + ": config"), {}, {}};
  if (j.contains("precision")) {
    DSV4_REQUIRE(j["precision"].is_string(), origin + ": field 'precision' is not a string");
    gc.precision = j["precision"].get<std::string>();
  }
  int64_t tokens = 0;
  for (size_t r = 0; r < requests.size(); ++r) {
    const std::string where = origin + ": requests[" + std::to_string(r) + "]";
    gc.requests.push_back(read_calls(requests[r], where, gc.config.max_position_embeddings));
    const GoldenCall& last = gc.requests.back().back();
    tokens += last.start_pos + last.len;  // each term below 2^31
    // A replay steps all requests together: their tokens must count in an int.
    DSV4_REQUIRE(tokens <= std::numeric_limits<int32_t>::max(),
            origin + ": the requests hold more than 2^31 - 1 tokens in all");
  }
  return gc;
}

namespace {

// Compressed entries of ratio m that positions [start, start + len) complete.
int64_t entries_completed(const GoldenCall& c, int m) { return (c.start_pos + c.len) / m - c.start_pos / m; }

std::string shape_str(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

// Checks one request's file against its calls.
class GoldenFileCheck {
 public:
  GoldenFileCheck(const GoldenCase& gc, int r, const SafetensorsFile& f, const std::set<std::string>& recorded)
      : gc_(gc), r_(r), f_(f), recorded_(recorded) {}

  void run() {
    const ModelConfig& c = gc_.config;
    const int64_t D = c.hidden_size, H = c.num_heads;
    const auto& calls = gc_.requests[size_t(r_)];
    for (int k = 0; k < int(calls.size()); ++k) {
      const int64_t len = calls[size_t(k)].len;
      expect(k, -1, name("input", k, -1), {len, D}, true);
      for (int l = 0; l < c.num_layers; ++l) {
        expect(k, l, name("output", k, l), {len, D}, true);
        expect(k, l, name("kv", k, l), {len, 512}, false);
        expect(k, l, name("q", k, l), {len, H, 512}, false);
        expect(k, l, name("attn", k, l), {len, H, 512}, false);
        const LayerType type = c.layer_type(l);
        if (type == LayerType::kSwaOnly) continue;
        const int64_t n = entries_completed(calls[size_t(k)], compress_ratio(type));
        entries(k, l, name("compressed", k, l), {n, 512});
        if (type != LayerType::kC4A) continue;
        entries(k, l, name("index_keys", k, l), {entries_completed(calls[size_t(k)], 4), 128});
        topk(k, l, name("topk", k, l), len);
      }
    }
  }

 private:
  // "<kind>.r<R>.c<K>" or "<kind>.r<R>.c<K>.l<L>" (snprintf: GCC 12 warns falsely on chained string +)
  std::string name(const char* kind, int k, int l) const {
    char buf[96];
    if (l < 0) std::snprintf(buf, sizeof buf, "%s.r%d.c%d", kind, r_, k);
    else std::snprintf(buf, sizeof buf, "%s.r%d.c%d.l%d", kind, r_, k, l);
    return buf;
  }

  std::string where(int k, int l, const std::string& key) const {
    return f_.origin() + ": request " + std::to_string(r_) + ", call " + std::to_string(k) +
           (l >= 0 ? ", layer " + std::to_string(l) : "") + ": tensor '" + key + "'";
  }

  void expect(int k, int l, const std::string& key, const std::vector<int64_t>& shape, bool required) {
    const TensorView* t = f_.find(key);
    if (!t) {
      DSV4_REQUIRE(!required, where(k, l, key) + " is missing");
      return;
    }
    DSV4_REQUIRE(t->dtype == DType::kF32 || t->dtype == DType::kBF16,
            where(k, l, key) + " is " + std::string(dtype_name(t->dtype)) + "; expected F32 or BF16");
    DSV4_REQUIRE(t->shape == shape, where(k, l, key) + " has shape " + shape_str(t->shape) + "; expected " +
                                   shape_str(shape));
  }

  // Entry tensors: a golden that records the kind at all may leave out empty ones.
  void entries(int k, int l, const std::string& key, const std::vector<int64_t>& shape) {
    const std::string kind = key.substr(0, key.find('.'));
    const bool required = recorded_.count(kind) && shape[0] > 0;
    if (!f_.find(key) && required)
      throw Error(where(k, l, key) + " is missing: the call completes " + std::to_string(shape[0]) + " entries");
    expect(k, l, key, shape, false);
  }

  void topk(int k, int l, const std::string& key, int64_t len) {
    const TensorView* t = f_.find(key);
    if (!t) return;
    DSV4_REQUIRE(t->dtype == DType::kI32, where(k, l, key) + " is " + std::string(dtype_name(t->dtype)) + "; expected I32");
    DSV4_REQUIRE(t->shape.size() == 2 && t->shape[0] == len && t->shape[1] <= gc_.config.index_topk,
            where(k, l, key) + " has shape " + shape_str(t->shape) + "; expected [" + std::to_string(len) +
                ", k] with k <= index_topk (" + std::to_string(gc_.config.index_topk) + ")");
  }

  const GoldenCase& gc_;
  int r_;
  const SafetensorsFile& f_;
  const std::set<std::string>& recorded_;
};

}  // namespace

void validate_golden_case(const GoldenCase& gc) {
  std::vector<std::unique_ptr<SafetensorsFile>> files;
  std::set<std::string> recorded;  // tensor kinds that appear anywhere in the case
  for (size_t r = 0; r < gc.requests.size(); ++r) {
    const auto path = gc.dir / (gc.name + ".r" + std::to_string(r) + ".safetensors");
    const std::string problem = file_problem(path);
    DSV4_REQUIRE(problem.empty(), "golden case " + gc.name + ": the file of request " + std::to_string(r) + ", " +
                                 path.string() + ", " + problem);
    files.push_back(SafetensorsFile::open(path));
    for (const TensorView& t : files.back()->tensors()) recorded.insert(t.name.substr(0, t.name.find('.')));
  }
  for (size_t r = 0; r < files.size(); ++r) GoldenFileCheck(gc, int(r), *files[r], recorded).run();
}

namespace {

// Both sizes equal and every value finite (metric() checks that first).
double rel_l2(const std::vector<float>& ours, const std::vector<float>& ref) {
  double num = 0, den = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    num += (double(ours[i]) - ref[i]) * (double(ours[i]) - ref[i]);
    den += double(ref[i]) * ref[i];
  }
  if (den == 0) return num == 0 ? 0 : std::numeric_limits<double>::infinity();
  return std::sqrt(num / den);
}

int64_t count_nonfinite(const std::vector<float>& v) {
  int64_t n = 0;
  for (float x : v) n += !std::isfinite(x);
  return n;
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
      const std::vector<float> all = in->floats();
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

  // Whether the golden records tensors of this kind anywhere (e.g. "compressed").
  bool records(const std::string& kind) {
    if (recorded_.empty()) {
      recorded_.insert("");  // computed
      for (const auto& f : files_)
        for (const TensorView& t : f->tensors()) recorded_.insert(t.name.substr(0, t.name.find('.')));
    }
    return recorded_.count(kind) > 0;
  }

  void metric(int r, int call, int l, const std::string& name, const std::vector<float>& ours) {
    ReplayMetric m{r, call, l, name};
    m.ours_count = int64_t(ours.size());
    m.nonfinite = count_nonfinite(ours);
    const TensorView* ref = golden(r, name + "." + tag(r, call, l));
    if (!ref) {
      // The fp8 case leaves out entry tensors with no rows: where the golden
      // records the kind, absence means empty, and ours must be empty too.
      // Otherwise the golden does not hold the tensor: nothing to compare
      // (shown as absent), though a non-finite value of ours still counts.
      const bool empty_in_golden = (name == "compressed" || name == "index_keys") && records(name);
      if (empty_in_golden && !ours.empty()) {
        m.size_mismatch = true;
        m.value = std::numeric_limits<double>::infinity();
      } else if (m.nonfinite > 0) {
        m.value = std::numeric_limits<double>::quiet_NaN();
      } else {
        return;
      }
      result_.metrics.push_back(m);
      return;
    }
    const std::vector<float> g = ref->floats();
    m.count = int64_t(g.size());
    m.nonfinite += count_nonfinite(g);
    if (ours.size() != g.size()) {
      m.size_mismatch = true;
      m.value = std::numeric_limits<double>::infinity();
    } else if (m.nonfinite > 0) {
      m.value = std::numeric_limits<double>::quiet_NaN();
    } else {
      m.value = rel_l2(ours, g);
    }
    result_.metrics.push_back(m);
  }

  // Shape and dtype were checked by validate_golden_case.
  void topk_metric(int r, int call, int l, const std::vector<std::vector<int32_t>>& ours) {
    const TensorView* ref = golden(r, "topk." + tag(r, call, l));
    if (!ref) return;
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
    ReplayMetric m{r, call, l, "topk", total ? double(matched) / double(total) : 1.0, total};
    m.ours_count = int64_t(ours.size());
    m.size_mismatch = m.ours_count != rows;
    result_.metrics.push_back(m);
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
  std::set<std::string> recorded_;  // see records()
  ReplayResult result_;
};

}  // namespace

ReplayResult replay_golden(const GoldenCase& gc, const ReplayOptions& options) {
  if (options.profile == Profile::kProduction) check_production_dims(gc.config);
  validate_golden_case(gc);
  return Replayer(gc, options).run();
}

MetricSummary summarize(const std::vector<ReplayMetric>& metrics, const std::string& tensor) {
  std::vector<double> v;
  MetricSummary s;
  int64_t picks = 0;
  double matched = 0;
  for (const auto& m : metrics) {
    if (m.tensor != tensor) continue;
    ++s.count;
    s.nonfinite_values += m.nonfinite;
    s.size_mismatches += m.size_mismatch;
    if (std::isnan(m.value)) continue;  // NaN has no place in an order
    v.push_back(m.value);
    if (std::isfinite(m.value)) {
      picks += m.count;
      matched += m.value * double(m.count);
    }
  }
  s.compared = int64_t(v.size());
  s.topk_overlap = picks ? matched / double(picks) : 1.0;
  if (v.empty()) {
    s.median = s.p90 = s.p99 = s.max = std::numeric_limits<double>::quiet_NaN();
    return s;
  }
  std::sort(v.begin(), v.end());
  auto pct = [&](double p) { return v[std::min(v.size() - 1, size_t(p * double(v.size() - 1) + 0.5))]; };
  s.median = pct(0.5), s.p90 = pct(0.9), s.p99 = pct(0.99), s.max = v.back();
  return s;
}

namespace {

std::string metric_place(const ReplayMetric& m) {
  char buf[128];
  std::snprintf(buf, sizeof buf, "%s r%d c%d l%d", m.tensor.c_str(), m.request, m.call, m.layer);
  return buf;
}

// Why the metrics cannot be trusted at all, or "".
std::string structural_failure(const std::vector<ReplayMetric>& metrics) {
  std::map<std::string, int64_t> nonfinite;
  const ReplayMetric *first_nonfinite = nullptr, *first_mismatch = nullptr;
  int64_t mismatches = 0, total = 0;
  for (const auto& m : metrics) {
    if (m.nonfinite > 0) {
      nonfinite[m.tensor] += m.nonfinite;
      total += m.nonfinite;
      if (!first_nonfinite) first_nonfinite = &m;
    }
    if (m.size_mismatch) {
      ++mismatches;
      if (!first_mismatch) first_mismatch = &m;
    }
  }
  if (total > 0) {
    std::string by;
    for (const auto& [t, n] : nonfinite) by += (by.empty() ? "" : ", ") + t + " " + std::to_string(n);
    return std::to_string(total) + " values were not finite (NaN or Inf, ours or the reference's): " + by +
           "; first in " + metric_place(*first_nonfinite);
  }
  if (mismatches > 0) {
    const ReplayMetric& m = *first_mismatch;
    const char* unit = m.tensor == "topk" ? " rows" : " values";
    char buf[256];
    std::snprintf(buf, sizeof buf, "%lld tensors differ in size from the reference; first %s: ours %lld%s",
                  (long long)mismatches, metric_place(m).c_str(), (long long)m.ours_count, unit);
    return buf;
  }
  return "";
}

}  // namespace

std::string judge_replay(const ReplayResult& r, Profile profile) {
  if (std::string why = structural_failure(r.metrics); !why.empty()) return why;
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
