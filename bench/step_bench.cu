// The step benchmark of issue #12 (SPEC §8): the whole attention stack of
// V4-Flash (synthetic FP8 weights) on one GPU through the engine.
//  - decode: one token per request per step, timed by CUDA-graph replay, for
//    batch {1, 8, 32, 128} x context {4K, 64K} and batch {1, 8} x 1M. The
//    caches are filled with random valid records (cache/synthetic_fill.h)
//    and the requests fast-forwarded to the context instead of prefilled.
//  - prefill: one 64K-token prompt in 8K-token chunks (a real prefill), then
//    16 decode steps over the caches it wrote (a server's decode, beside the
//    rows' synthetic caches: finalize selects differently over real keys).
//  - --prefill LEN: only one request prefilled to LEN tokens in 8K chunks
//    (1048560 for the 1M row), then 16 decode steps: time, where it went,
//    cache memory held.
//  - --decode BATCH CONTEXT: only that decode row (to run under a profiler);
//    repeated, those rows in that order on one engine (for A/B calls).
//  - --no-short-select: decode steps of short rows select with plan, score
//    and finalize, not run_short's one kernel (CudaBackendOptions::short_select).
//  - --serial: every kernel of a layer on one stream (CudaBackendOptions::lanes
//    off), to measure what the lanes overlap; --lanes-max N: lanes in steps of
//    up to N rows (EngineOptions::cuda_lanes_max_tokens; default 128).
//  - --attn-decode-max N: the sparse attention's decode kernel in steps of up
//    to N rows (EngineOptions::cuda_attention_decode_max_tokens; default 16;
//    0: the tile kernel and its combine in every step); --attn-decode-entries
//    N: for rows of up to N entries (cuda_attention_decode_max_entries;
//    default and at most 1,024); --attn-decode-warps N: its CTAs of N warps
//    (4, 8 or 16; cuda_attention_decode_warps, default 0: chosen per call).
//  - --index-keys fp8|mxfp4: the indexer's key cache (default mxfp4, the
//    engine's; fp8 is vLLM's default, SPEC §5).
//  - --trace FILE: with --decode, one more replayed step under CUPTI's kernel
//    records (kernel_trace.h); with --prefill, the last of its 16 decode
//    steps (over the caches the prefill wrote): every kernel's start, end and
//    stream to FILE (CSV), and a summary of where the step's time went.
//  - --stagger: a decode row's requests spread over one C128A block (request
//    b at context - b * 128 / batch) instead of all at the context: a
//    server's steady state, where every step of 128 requests completes a
//    C128A entry (and 32 C4A ones), which aligned requests do once in 128
//    steps (and the rows' few timed steps may never see).
//  - --stamps (with --decode): wo_a's small-M kernel writes per-CTA timer
//    stamps in every step (small_m_stamps.h); after each decode row, the
//    phases of the last layer's wo_a in the last step (at up to 8 rows).
// Step times are wall time of plan + forward + commit; the synthetic input
// embeddings (host Box-Muller, on every core) are drawn outside the timed
// span, as a server receives them from the embedding.
// Per row: time, bytes moved (weights + caches read and written), the
// roofline at 4.3 TB/s (issue #12's H200; --bandwidth TB/s for another
// device), the ratio, time per layer type. --json FILE too. The first line
// names the device and its peak memory bandwidth (clock x bus width), so
// that a table from another GPU is not read against the H200's roofline.
#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <cuda_runtime.h>
#include <nlohmann/json.hpp>

#include "bench_util.cuh"
#include "cache/fp8_ds_mla.h"
#include "common/error.h"
#include "kernel_trace.h"
#include "small_m_stamps.h"
#include "runtime/engine.h"
#include "model/weights.h"
#include "runtime/workload.h"

using namespace dsv4;

namespace {

// Bytes per second of the roofline: the H200's measured 4.3 TB/s unless
// --bandwidth says otherwise.
double g_bandwidth = 4.3e12;

// "NAME, N SMs, peak X TB/s" of the current device (its memory clock times
// its bus width, double data rate), or why not.
std::string device_line() {
  int dev = 0, clock_khz = 0, bus_bits = 0;
  cudaDeviceProp prop{};
  if (cudaGetDevice(&dev) != cudaSuccess || cudaGetDeviceProperties(&prop, dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&clock_khz, cudaDevAttrMemoryClockRate, dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&bus_bits, cudaDevAttrGlobalMemoryBusWidth, dev) != cudaSuccess) {
    cudaGetLastError();
    return "no CUDA device";
  }
  char tail[96];
  std::snprintf(tail, sizeof tail, ", %d SMs, peak %.2f TB/s", prop.multiProcessorCount,
                2.0 * clock_khz * 1e3 * bus_bits / 8 / 1e12);
  return std::string(prop.name) + tail;
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// Bytes one decode token at position pos reads and writes in the caches,
// over all layers (SPEC §8): window and selected/visible compressed entries
// (584 B each), the indexer's scan of every visible C4A key, the SWA record
// and state rows it writes.
double cache_bytes_per_token(const ModelConfig& c, const CacheSpec& spec, int64_t pos) {
  const double key = spec.formats().index_keys == IndexKeyFormat::kFp8 ? 132 : 68;
  double bytes = 0;
  for (int l = 0; l < c.num_layers; ++l) {
    const LayerType t = c.layer_type(l);
    const double window = double(std::min<int64_t>(pos + 1, 128));
    bytes += (window + 1) * kKvEntryBytes;  // read the window, write one record
    if (t == LayerType::kC4A) {
      const double visible = double((pos + 1) / 4);
      bytes += std::min(visible, double(c.index_topk)) * kKvEntryBytes + visible * key;
      bytes += 8.0 * 2 * 2 * (512 + 128) * 4;  // the state rows the block end reads
    } else if (t == LayerType::kC128A) {
      bytes += double((pos + 1) / 128) * kKvEntryBytes + 2 * 512 * 4;
    }
  }
  return bytes;
}

struct Bench {
  ModelConfig config = preset_config("flash");
  std::unique_ptr<Engine> engine;
  std::vector<float> x, y;
  nlohmann::json rows = nlohmann::json::array();
  int64_t next_id = 0;
  std::string trace_csv;  // --trace
  bench::SmallMStamps* stamps = nullptr;  // --stamps
  bool stagger = false;                   // --stagger

  // `o`: the command line's engine options; the workload is this bench's.
  Bench(int64_t max_requests, int64_t max_context, EngineOptions o) {
    o.device = Device::kCuda;
    o.workload = CacheWorkload{max_requests, max_context, 8192};
    const auto t0 = std::chrono::steady_clock::now();
    engine = Engine::from_seed(config, 1, o);
    const BackendMemory m = engine->backend().memory();
    std::printf("engine: %.1f s to build; %s indexer keys, short decode rows selected %s; device memory: weights "
                "%.2f GB, caches %.2f GB, workspace %.2f GB; admits %lld tokens of context\n",
                seconds_since(t0), std::string(index_key_format_name(o.index_keys)).c_str(),
                o.cuda_short_select ? "in one kernel" : "by plan, score and finalize", m.weights / 1e9,
                m.caches / 1e9, m.workspace / 1e9,
                (long long)engine->blocks().limits().context_tokens(engine->cache_spec()));
    engine->fill_caches_synthetic(7);
  }

  // Bytes of weights a decode step reads (SPEC §8): every matrix once, FP8
  // ones as FP8 (the small-M kernels read wo_a's FP8 form, not its bf16
  // copy), bf16 ones as bf16, plus vectors and scales.
  double weight_bytes() const {
    double bytes = 0;
    for (int l = 0; l < config.num_layers; ++l)
      for (const TensorSpec& t : attention_tensor_specs(config, l)) {
        double n = 1;
        for (int64_t d : t.shape) n *= double(d);
        bytes += t.kind == TensorKind::kFp8Matrix ? n * (1.0 + 4.0 / (128 * 128))
                 : t.kind == TensorKind::kDenseMatrix ? 2 * n
                                                      : 4 * n;
      }
    return bytes;
  }

  // One engine step over `runs`; returns wall seconds of plan, copies,
  // forward (or replay) and commit, not of drawing the inputs.
  double step(const std::vector<dsv4::Run>& runs, std::array<double, kNumLayerTypes>* layer_s) {
    const auto t0 = std::chrono::steady_clock::now();
    std::vector<RunError> errors;
    const StepMetadata s = engine->plan(runs, errors);
    if (!errors.empty()) throw Error("step rejected: " + errors[0].message);
    const double plan_s = seconds_since(t0);
    const size_t n = size_t(s.num_tokens()) * size_t(config.hidden_size);
    x.resize(n), y.resize(n);
    draw_embeddings(s);
    const auto t1 = std::chrono::steady_clock::now();
    engine->forward_step(s, x, y, layer_s);
    engine->commit(s);
    return plan_s + seconds_since(t1);
  }

  // The step's input embeddings, drawn on every host core: on one, an 8K
  // chunk's took 1.3-2.4 s (runs AL4, AM2), as long as the chunk's step at
  // 400K-1M of context. (Decode steps' few rows stay on this thread.)
  void draw_embeddings(const StepMetadata& s) {
    const int T = s.num_tokens(), D = config.hidden_size;
    auto draw = [&](int first, int stride) {
      for (int t = first; t < T; t += stride)
        synthetic_embedding(1, s.runs[size_t(s.token_run()[size_t(t)])].request, s.positions()[size_t(t)], D,
                            x.data() + size_t(t) * D);
    };
    const int n = std::clamp(std::min(int(std::thread::hardware_concurrency()), (T + 255) / 256), 1, 32);
    std::vector<std::thread> pool;
    for (int w = 1; w < n; ++w) pool.emplace_back(draw, w, n);
    draw(0, n);
    for (auto& th : pool) th.join();
  }

  // A step under CUPTI's kernel records, written to trace_csv; its seconds.
  double traced_step(const std::vector<dsv4::Run>& runs) {
    bench::KernelTrace trace;
    trace.start();
    const double t = step(runs, nullptr);
    trace.stop();
    trace.write_csv(trace_csv);
    trace.summary(30);
    return t;
  }

  void decode_row(int batch, int64_t context, int steps) {
    std::vector<int64_t> ids, start;
    for (int b = 0; b < batch; ++b) {
      ids.push_back(next_id++);
      start.push_back(context - (stagger ? int64_t(b) * 128 / batch : 0));
      engine->open_request(ids.back());
      engine->fast_forward(ids.back(), start.back());
    }
    auto runs_at = [&](int k) {
      std::vector<dsv4::Run> runs;
      for (size_t b = 0; b < ids.size(); ++b) runs.push_back({ids[b], start[b] + k, 1});
      return runs;
    };
    int k = 0;
    for (; k < 3; ++k) step(runs_at(k), nullptr);  // eager, captured, replayed
    std::vector<double> wall;
    for (int i = 0; i < steps; ++i, ++k) wall.push_back(step(runs_at(k), nullptr));
    std::array<double, kNumLayerTypes> per_type{};
    for (int i = 0; i < 2; ++i, ++k) step(runs_at(k), &per_type);  // timed replays: eager, captured
    per_type = {};
    step(runs_at(k++), &per_type);  // a timed replay
    if (!trace_csv.empty()) traced_step(runs_at(k++));
    const double t = dsv4::bench::median(wall);
    const double bytes = weight_bytes() + batch * cache_bytes_per_token(config, engine->cache_spec(), context);
    const double roof = bytes / g_bandwidth;
    std::printf("| decode | %3d | %8lld | %8.3f | %9.2f | %8.3f | %5.2f | %7.3f %7.3f %7.3f | %9.1f |\n", batch,
                (long long)context, t * 1e3, bytes / 1e9, roof * 1e3, t / roof, per_type[0] * 1e3, per_type[1] * 1e3,
                per_type[2] * 1e3, batch / t);
    std::fflush(stdout);
    rows.push_back({{"kind", "decode"}, {"batch", batch}, {"context", context}, {"step_ms", t * 1e3},
                    {"bytes", bytes}, {"roofline_ms", roof * 1e3}, {"roofline_tbps", g_bandwidth / 1e12}, {"ratio", t / roof},
                    {"ms_per_type", {{"swaonly", per_type[0] * 1e3}, {"c4a", per_type[1] * 1e3},
                                     {"c128a", per_type[2] * 1e3}}},
                    {"tokens_per_s", batch / t}, {"caches", "synthetic (random valid records)"},
                    {"staggered", stagger}});
    if (stamps != nullptr && batch <= 8) {
      char label[96];
      std::snprintf(label, sizeof label, "wo_a of the last layer, last step, %d x %lld", batch, (long long)context);
      stamps->print(label);
    }
    for (int64_t id : ids) engine->close_request(id);
  }

  // One prompt of `length` tokens in chunks; returns seconds. Decodes `gen` after.
  void prefill_row(int64_t length, int chunk, int gen, bool verbose) {
    const int64_t id = next_id++;
    engine->open_request(id);
    double total = 0, indexer = 0;
    std::array<double, kNumLayerTypes> per_type{};
    nlohmann::json chunks = nlohmann::json::array();  // [position, seconds, indexer seconds] of each chunk
    for (int64_t pos = 0; pos < length; pos += chunk) {
      const int len = int(std::min<int64_t>(chunk, length - pos));
      const double t = step({{id, pos, len}}, &per_type);
      const double idx = engine->backend().indexer_seconds();
      total += t, indexer += idx;
      chunks.push_back({pos, t, idx});
      if (verbose) std::printf("  chunk at %8lld: %.3f s (indexer %.3f s)\n", (long long)pos, t, idx);
    }
    const double held = double(engine->blocks().bytes_in_use());
    std::printf("| prefill | 1 | %8lld | %8.1f s | %8.0f tok/s | indexer %.1f%% | swa %.2f c4a %.2f c128a %.2f s | "
                "caches held %.2f GB |\n",
                (long long)length, total, length / total, 100 * indexer / total, per_type[0], per_type[1],
                per_type[2], held / 1e9);
    std::fflush(stdout);
    nlohmann::json row = {{"kind", "prefill"}, {"length", length}, {"chunk", chunk}, {"seconds", total},
                          {"tokens_per_s", length / total}, {"indexer_seconds", indexer},
                          {"seconds_per_type", {{"swaonly", per_type[0]}, {"c4a", per_type[1]}, {"c128a", per_type[2]}}},
                          {"cache_bytes_held", held}, {"chunks", chunks}};
    if (gen > 0) {
      std::vector<double> wall;
      // With --trace the last of them is traced: a decode step over caches a
      // real prefill wrote, against the decode rows' synthetic records.
      for (int k = 0; k < gen; ++k) {
        const std::vector<dsv4::Run> runs = {{id, length + k, 1}};
        wall.push_back(!trace_csv.empty() && k == gen - 1 ? traced_step(runs) : step(runs, nullptr));
      }
      const double t = dsv4::bench::median(wall);
      std::printf("  then decode at %lld: %.3f ms per step (median of %d)\n", (long long)length, t * 1e3, gen);
      row["decode_step_ms"] = t * 1e3;
    }
    rows.push_back(row);
    engine->close_request(id);
  }
};

}  // namespace

int main(int argc, char** argv) {
  bool quick = false, stagger = false;
  int64_t prefill_only = 0;
  std::vector<std::pair<int, int64_t>> decode;  // --decode rows
  std::string json, trace;
  bool stamps = false;
  EngineOptions eo;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--quick") quick = true;
    else if (a == "--stagger") stagger = true;
    else if (a == "--serial") eo.cuda_lanes = false;
    else if (a == "--no-short-select") eo.cuda_short_select = false;
    else if (a == "--lanes-max" && i + 1 < argc) eo.cuda_lanes_max_tokens = std::atoll(argv[++i]);
    else if (a == "--attn-decode-max" && i + 1 < argc) eo.cuda_attention_decode_max_tokens = std::atoi(argv[++i]);
    else if (a == "--attn-decode-entries" && i + 1 < argc) eo.cuda_attention_decode_max_entries = std::atoi(argv[++i]);
    else if (a == "--attn-decode-warps" && i + 1 < argc) eo.cuda_attention_decode_warps = std::atoi(argv[++i]);
    else if (a == "--prefill" && i + 1 < argc && (prefill_only = std::atoll(argv[i + 1])) > 0) ++i;
    else if (a == "--decode" && i + 2 < argc && std::atoi(argv[i + 1]) > 0 && std::atoll(argv[i + 2]) > 0) {
      decode.emplace_back(std::atoi(argv[i + 1]), std::atoll(argv[i + 2]));
      i += 2;
    }
    else if (a == "--json" && i + 1 < argc) json = argv[++i];
    else if (a == "--trace" && i + 1 < argc) trace = argv[++i];
    else if (a == "--stamps") stamps = true;
    else if (a == "--gpu-memory" && i + 1 < argc) eo.gpu_memory = std::atof(argv[++i]);
    else if (a == "--bandwidth" && i + 1 < argc) {
      const double tbps = std::atof(argv[++i]);
      if (!(tbps > 0 && tbps < 100)) {
        std::fprintf(stderr, "%s: --bandwidth wants TB/s between 0 and 100, not '%s'\n", argv[0], argv[i]);
        return 2;
      }
      g_bandwidth = tbps * 1e12;
    }
    else if (a == "--index-keys" && i + 1 < argc) {
      try {
        eo.index_keys = parse_index_key_format(argv[++i]);
      } catch (const std::exception& e) {
        std::fprintf(stderr, "%s: %s\n", argv[0], e.what());
        return 2;
      }
    }
    else {
      std::fprintf(stderr, "usage: %s [--quick] [--serial] [--no-short-select] [--lanes-max N] [--attn-decode-max N] [--attn-decode-entries N] [--attn-decode-warps N] [--prefill LEN [--trace CSV] | --decode BATCH CONTEXT [--decode B C ...] [--trace CSV] [--stamps] [--stagger]] [--json FILE] [--gpu-memory F] [--index-keys fp8|mxfp4] [--bandwidth TB/s]\n", argv[0]);
      return 2;
    }
  }
  if (stamps && decode.empty()) {
    std::fprintf(stderr, "%s: --stamps needs --decode rows\n", argv[0]);
    return 2;
  }
  if (!trace.empty() && decode.size() != 1 && prefill_only == 0) {
    std::fprintf(stderr, "%s: --trace needs --prefill LEN or one --decode BATCH CONTEXT (it traces one decode step)\n", argv[0]);
    return 2;
  }
  std::printf("device: %s; roofline at %.2f TB/s\n", device_line().c_str(), g_bandwidth / 1e12);
  try {
    if (prefill_only > 0) {
      Bench b(1, prefill_only + 16, eo);
      b.trace_csv = trace;
      b.prefill_row(prefill_only, 8192, 16, true);
      if (!json.empty()) std::ofstream(json) << b.rows.dump(2) << "\n";
      return 0;
    }
    if (!decode.empty()) {  // these decode rows only
      int batch = 0;
      int64_t context = 0;
      for (const auto& [bt, ctx] : decode) batch = std::max(batch, bt), context = std::max(context, ctx);
      std::unique_ptr<bench::SmallMStamps> stamp_buffer;
      if (stamps) {  // before any step: the graphs are captured with the buffer
        stamp_buffer = std::make_unique<bench::SmallMStamps>();
        stamp_buffer->on();
      }
      Bench b(batch, context + 64, eo);
      b.trace_csv = trace;
      b.stagger = stagger;
      b.stamps = stamp_buffer.get();
      for (const auto& [bt, ctx] : decode) b.decode_row(bt, ctx, quick ? 5 : 20);
      if (!json.empty()) std::ofstream(json) << b.rows.dump(2) << "\n";
      return 0;
    }
    Bench b(128, int64_t(1) << 20, eo);
    b.stagger = stagger;
    std::printf("\nweights %.2f GB per step: floor %.3f ms at %.2f TB/s\n", b.weight_bytes() / 1e9,
                b.weight_bytes() / g_bandwidth * 1e3, g_bandwidth / 1e12);
    std::printf("| row | batch | context | step ms | GB moved | roofline ms | ratio | swaonly c4a c128a ms | tok/s |\n"
                "|---|---|---|---|---|---|---|---|---|\n");
    const int steps = quick ? 5 : 20;
    for (int64_t ctx : {int64_t(4096), int64_t(65536)})
      for (int batch : {1, 8, 32, 128}) b.decode_row(batch, ctx, steps);
    // 1M context, less room for the steps the row decodes (positions < 2^20).
    for (int batch : {1, 8}) b.decode_row(batch, (int64_t(1) << 20) - 64, steps);
    b.prefill_row(65536, 8192, 16, false);
    if (!json.empty()) std::ofstream(json) << b.rows.dump(2) << "\n";
  } catch (const std::exception& e) {
    std::fprintf(stderr, "step_bench: %s\n", e.what());
    return 1;
  }
  return 0;
}
