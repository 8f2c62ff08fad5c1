// Times the CUDA lightning-indexer selection (attn/cuda/indexer_select_cuda.h)
// at the sizes of the issue: decode (T = 1, 8, 128 tokens, each its own
// request) at 4K, 64K and 1M context, and one prefill chunk of 8,192 tokens
// at 8K (the first chunk), 64K and 1M context (the last chunk), with MXFP4 and
// FP8 keys and topk 512 (Flash) or 1024 (Pro).
//
// Every time is a median over graph replays (CUDA events around one replay
// of a graph of back-to-back calls, divided by their number: 20, fewer for
// calls above 1 ms so that a long row stays within seconds). Columns:
//   call      plan + score + finalize (one layer's selection)
//   plan      the plan kernel alone
//   score     the score kernel (tensor-core scoring + running top-k)
//   s-only    the score kernel without the running top-k (scoring only)
//   final     the finalize kernel (merge of the units' lists, sort, slots)
//   TFLOP/s   scoring FLOPs (2 * 64 * 128 per visible (query, key)) / call
//   key MB    key bytes a call must read: every request's visible keys once
//   roof      max(key bytes / 4.3 TB/s, FLOPs / 1,270 TFLOP/s) and call / roof
//   top-k %   (call - s-only) / call: the selection's share
// Inputs live only on the device (random codes, realistic scales); calls
// rotate over enough copies of the keys to exceed the 50 MB L2 where the
// keys of one call are smaller ("L2" marks the cases that still fit).
// Decode cases are planned one token per group (IndexerGrouping::
// kOneTokenPerRun, as the engine's decode steps), prefill chunks by runs;
// --runs plans every case by runs (the general score kernel); --units N cuts
// every call into about N units (IndexerSelectCudaLimits::work_units; the
// default is the op's).
// --exact-every N gives every N-th token (N - 1, 2N - 1, ...) a head weight
// of 2^-100, outside the score kernel's fast path (indexer_score.cu,
// weight_ok): those tokens' scores take its exact scalar path, whose cost
// this measures.
// Usage: indexer_bench [--quick] [--format mxfp4|fp8] [--topk N] [--tokens T]
//                      [--context C] [--runs] [--units N] [--exact-every N]
//   (--tokens / --context keep only the cases of that T / context)
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "attn/cuda/indexer_select_cuda.h"

#include "bench_util.cuh"

namespace {

constexpr int kMaxReps = 20;
constexpr int kTimings = 9;
using dsv4::bench::kPeakBytes;
constexpr double kPeakFlops = dsv4::bench::kPeakFp8;
constexpr double kL2Bytes = 50e6;

// Key pages: random codes; MXFP4 scale bytes 124..126 (blocks within 2
// binades, the fast path), FP8 scales 2^-8 and no NaN codes.
__global__ void fill_pages(uint8_t* base, int64_t pages, size_t stride, bool fp8, uint64_t seed) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;  // one entry
  if (i >= pages * 64) return;
  uint8_t* page = base + size_t(i / 64) * stride;
  const int t = int(i % 64);
  const int code_bytes = fp8 ? 128 : 64;
  for (int k = 0; k < code_bytes; k += 4) {
    uint32_t w = dsv4::bench::mix32(seed ^ (uint64_t(i) << 8) ^ uint64_t(k));
    if (fp8) w &= 0xf7f7f7f7u;  // clears bit 3 of every byte: no 0x7f / 0xff
    std::memcpy(page + size_t(code_bytes) * t + k, &w, 4);
  }
  uint8_t* sc = page + size_t(code_bytes) * 64 + 4 * size_t(t);
  if (fp8) {
    const float s = 0x1p-8f;
    std::memcpy(sc, &s, 4);
  } else {
    for (int b = 0; b < 4; ++b) sc[b] = uint8_t(124 + dsv4::bench::mix32(seed ^ (uint64_t(i) << 8) ^ uint64_t(200 + b)) % 3);
  }
}

__global__ void fill_queries(uint8_t* codes, uint8_t* scales, float* weights, int64_t records, bool fp8, int exact_every,
                             uint64_t seed) {
  const int64_t e = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (e >= records) return;
  const int code_bytes = fp8 ? 128 : 64;
  for (int k = 0; k < code_bytes; k += 4) {
    uint32_t w = dsv4::bench::mix32(seed ^ (uint64_t(e) << 8) ^ uint64_t(k));
    if (fp8) w &= 0xf7f7f7f7u;
    std::memcpy(codes + size_t(code_bytes) * e + k, &w, 4);
  }
  if (fp8) {
    const float s = 0x1p-6f;
    std::memcpy(scales + 4 * e, &s, 4);
  } else {
    for (int b = 0; b < 4; ++b) scales[4 * e + b] = uint8_t(125 + dsv4::bench::mix32(seed ^ (uint64_t(e) << 8) ^ uint64_t(300 + b)) % 2);
  }
  const uint32_t r = dsv4::bench::mix32(seed ^ uint64_t(e) ^ 0x77);
  weights[e] = __uint_as_float((uint32_t((r & 1) << 31)) | (uint32_t(119 + (r >> 1) % 4) << 23) | ((r >> 8) & 0x7f) << 16);
  if (exact_every > 0 && e % 64 == 0 && (e / 64) % exact_every == exact_every - 1) weights[e] = 0x1p-100f;  // head 0
}

template <typename T>
T* upload(const std::vector<T>& v, std::vector<void*>& owned) {
  T* d = nullptr;
  CHECK(cudaMalloc(&d, std::max<size_t>(1, v.size() * sizeof(T))));
  CHECK(cudaMemcpy(d, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice));
  owned.push_back(d);
  return d;
}

struct Case {
  const char* name;
  int tokens;          // T
  int64_t context;     // tokens of context of each request (decode) or of the chunk's last token
  bool prefill;        // one request, T consecutive positions ending at context - 1
};

// One call's inputs, `rotations` times over disjoint key pages.
struct World {
  int T = 0, rotations = 1;
  dsv4::IndexerGrouping grouping = dsv4::IndexerGrouping::kRuns;
  std::vector<dsv4::IndexerSelectParams> params;  // per rotation
  double flops = 0, key_bytes = 0;
  std::vector<void*> owned;
  ~World() {
    for (void* p : owned) cudaFree(p);
  }
};

void build(World& w, const Case& c, dsv4::IndexKeyFormat f, int topk, bool by_runs, int exact_every, uint64_t seed) {
  const bool fp8 = f == dsv4::IndexKeyFormat::kFp8;
  const int T = c.tokens;
  w.grouping = c.prefill || by_runs ? dsv4::IndexerGrouping::kRuns : dsv4::IndexerGrouping::kOneTokenPerRun;
  const int runs = c.prefill ? 1 : T;
  std::vector<int32_t> positions(static_cast<size_t>(T));
  std::vector<int32_t> token_run(static_cast<size_t>(T));
  for (int t = 0; t < T; ++t) {
    positions[size_t(t)] = c.prefill ? c.context - T + t : c.context - 1;
    token_run[size_t(t)] = c.prefill ? 0 : t;
    w.flops += 2.0 * 64 * 128 * double(dsv4::indexer_visible(positions[size_t(t)]));
  }
  const int64_t keys = dsv4::indexer_visible(c.prefill ? c.context - 1 : c.context - 1);
  const int width = int((keys + 63) / 64);
  const size_t stride = dsv4::index_key_page_stride(f, 64);
  w.key_bytes = double(runs) * double(keys) * dsv4::index_key_entry_bytes(f);
  w.rotations = int(std::clamp(std::ceil(2 * kL2Bytes / std::max(1.0, w.key_bytes)), 1.0, 16.0));
  const int64_t pages = int64_t(runs) * width * w.rotations;
  uint8_t* pool = nullptr;
  CHECK(cudaMalloc(&pool, size_t(pages) * stride));
  w.owned.push_back(pool);
  fill_pages<<<unsigned((pages * 64 + 255) / 256), 256>>>(pool, pages, stride, fp8, seed);
  CHECK(cudaGetLastError());
  const int64_t records = int64_t(T) * 64;
  uint8_t *codes = nullptr, *scales = nullptr;
  float* weights = nullptr;
  CHECK(cudaMalloc(&codes, size_t(records) * (fp8 ? 128 : 64)));
  CHECK(cudaMalloc(&scales, size_t(records) * 4));
  CHECK(cudaMalloc(&weights, size_t(records) * 4));
  w.owned.insert(w.owned.end(), {codes, scales, weights});
  fill_queries<<<unsigned((records + 255) / 256), 256>>>(codes, scales, weights, records, fp8, exact_every, seed + 1);
  CHECK(cudaGetLastError());
  int32_t *picks = nullptr, *slots = nullptr, *lengths = nullptr;
  CHECK(cudaMalloc(&picks, size_t(T) * topk * 4));
  CHECK(cudaMalloc(&slots, size_t(T) * topk * 4));
  CHECK(cudaMalloc(&lengths, size_t(T) * 4));
  w.owned.insert(w.owned.end(), {picks, slots, lengths});
  const int32_t* dpos = upload(positions, w.owned);
  const int32_t* drun = upload(token_run, w.owned);
  std::mt19937_64 rng(seed);
  std::vector<int32_t> first(static_cast<size_t>(runs), 0);
  const int32_t* dfirst = upload(first, w.owned);
  for (int rot = 0; rot < w.rotations; ++rot) {
    std::vector<int32_t> table(size_t(runs) * width);
    std::iota(table.begin(), table.end(), int32_t(int64_t(rot) * runs * width));
    std::shuffle(table.begin(), table.end(), rng);  // each request's pages scattered over its rotation's pool
    dsv4::IndexerSelectParams p;
    p.num_tokens = T;
    p.positions = dpos;
    p.token_run = drun;
    p.c4a_table = dsv4::BlockTableView{upload(table, w.owned), dfirst, width, 64};
    p.keys = dsv4::KvPages{pool, pages, 64, stride};
    p.queries = dsv4::IndexerQueries{f, T, 64, codes, scales, weights};
    p.topk = topk;
    p.picks = picks;
    p.slots = slots;
    p.lengths = lengths;
    w.params.push_back(p);
  }
  w.T = T;
}

enum class Stage { kCall, kPlan, kPlanScore, kPlanScoreOnly, kFinalize };

// Median time of one call of `stage`, in microseconds, over graphs of `reps`
// calls. The score kernel takes its units from a counter the plan resets, so
// it is timed after a plan (and the plan alone subtracted); finalize reads the
// lists the last call left.
double time_stage(dsv4::IndexerSelectCuda& op, const World& w, Stage stage, int reps, cudaStream_t s) {
  for (const auto& p : w.params) op.run(p, s, w.grouping);
  return dsv4::bench::graph_median_us(s, reps, kTimings, [&](cudaStream_t st) {
    for (int i = 0; i < reps; ++i) {
      const auto& p = w.params[size_t(i % w.rotations)];
      switch (stage) {
        case Stage::kCall: op.run(p, st, w.grouping); break;
        case Stage::kPlan: op.plan(p, st, w.grouping); break;
        case Stage::kPlanScore: op.plan(p, st, w.grouping); op.score(p, st); break;
        case Stage::kPlanScoreOnly: op.plan(p, st, w.grouping); op.score(p, st, true); break;
        case Stage::kFinalize: op.finalize(p, st); break;
      }
    }
  });
}

// Calls per graph: kMaxReps, fewer when a call takes more than a millisecond.
int reps_for(dsv4::IndexerSelectCuda& op, const World& w, cudaStream_t s) {
  const double once = time_stage(op, w, Stage::kCall, 1, s);
  return std::clamp(int(20000.0 / std::max(1.0, once)), 2, kMaxReps);
}

}  // namespace

int main(int argc, char** argv) {
  bool quick = false, by_runs = false;
  std::vector<dsv4::IndexKeyFormat> formats = {dsv4::IndexKeyFormat::kMxfp4, dsv4::IndexKeyFormat::kFp8};
  std::vector<int> topks = {512, 1024};
  int only_tokens = 0;
  int units = 0, exact_every = 0;
  int64_t only_context = 0;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--quick") quick = true;
    else if (a == "--format" && i + 1 < argc) formats = {dsv4::parse_index_key_format(argv[++i])};
    else if (a == "--topk" && i + 1 < argc) topks = {std::atoi(argv[++i])};
    else if (a == "--tokens" && i + 1 < argc) only_tokens = std::atoi(argv[++i]);
    else if (a == "--context" && i + 1 < argc) only_context = std::atoll(argv[++i]);
    else if (a == "--runs") by_runs = true;
    else if (a == "--units" && i + 1 < argc) units = std::atoi(argv[++i]);
    else if (a == "--exact-every" && i + 1 < argc && (exact_every = std::atoi(argv[i + 1])) > 0) ++i;
    else {
      std::fprintf(stderr,
                   "usage: %s [--quick] [--format mxfp4|fp8] [--topk N] [--tokens T] [--context C] [--runs] [--units N] "
                   "[--exact-every N]\n",
                   argv[0]);
      return 2;
    }
  }
  std::vector<Case> cases = {
      {"decode  4K", 1, 4096, false},      {"decode  4K", 8, 4096, false},      {"decode  4K", 128, 4096, false},
      {"decode 64K", 1, 65536, false},     {"decode 64K", 8, 65536, false},     {"decode 64K", 128, 65536, false},
      {"decode  1M", 1, 1048576, false},   {"decode  1M", 8, 1048576, false},   {"decode  1M", 128, 1048576, false},
      {"prefill 8K first", 8192, 8192, true}, {"prefill 64K last", 8192, 65536, true},
      {"prefill 1M last", 8192, 1048576, true}};
  if (quick) cases = {cases[5], cases[8], cases[10]};
  std::erase_if(cases, [&](const Case& c) {
    return (only_tokens > 0 && c.tokens != only_tokens) || (only_context > 0 && c.context != only_context);
  });
  if (cases.empty()) {
    std::fprintf(stderr, "no case has --tokens %d --context %lld\n", only_tokens, static_cast<long long>(only_context));
    return 2;
  }
  cudaStream_t s;
  CHECK(cudaStreamCreate(&s));
  for (dsv4::IndexKeyFormat f : formats) {
    for (int topk : topks) {
      std::printf("\n%s keys, topk %d, decode planned %s%s\n", std::string(dsv4::index_key_format_name(f)).c_str(), topk,
                  by_runs ? "by runs" : "one token per group",
                  exact_every > 0 ? (", every " + std::to_string(exact_every) + "-th token on the exact path").c_str() : "");
      std::printf("%-18s %5s %9s %8s %9s %9s %9s %8s %9s %9s %6s %7s\n", "case", "T", "call us", "plan us", "score us",
                  "s-only us", "final us", "TFLOP/s", "key MB", "roof us", "x roof", "top-k %");
      for (const Case& c : cases) {
        World w;
        build(w, c, f, topk, by_runs, exact_every, 1234 + uint64_t(c.tokens) * 7 + uint64_t(c.context));
        dsv4::IndexerSelectCuda op({c.tokens, topk, units});
        const int reps = reps_for(op, w, s);
        const double call = time_stage(op, w, Stage::kCall, reps, s);
        const double plan = time_stage(op, w, Stage::kPlan, reps, s);
        const double score = time_stage(op, w, Stage::kPlanScore, reps, s) - plan;
        const double score_only = time_stage(op, w, Stage::kPlanScoreOnly, reps, s) - plan;
        const double fin = time_stage(op, w, Stage::kFinalize, reps, s);
        const double roof = std::max(w.key_bytes / kPeakBytes, w.flops / kPeakFlops) * 1e6;
        const bool l2 = w.key_bytes * w.rotations < kL2Bytes;
        std::printf("%-18s %5d %9.1f %8.1f %9.1f %9.1f %9.1f %8.1f %9.2f %9.2f %6.2f %7.1f%s\n", c.name, c.tokens, call,
                    plan, score, score_only, fin, w.flops / (call * 1e-6) / 1e12, w.key_bytes / 1e6, roof, call / roof,
                    100.0 * (call - score_only) / call, l2 ? "  L2" : "");
      }
    }
  }
  CHECK(cudaStreamSynchronize(s));
  cudaStreamDestroy(s);
  return 0;
}
