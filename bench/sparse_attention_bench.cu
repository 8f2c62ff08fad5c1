// Times the GPU sparse attention on the rows of SPEC §8 (decode: one query
// token per request, window 128 + extra entries) and on one prefill chunk,
// next to FlashMLA's times from that table and the H200 roofline.
//
// Every number is a median over graph replays (CUDA events around one
// replay of a graph holding kReps back-to-back calls, divided by kReps), so
// launch gaps inside a step's graph are counted but the graph launch itself
// is amortised. Columns:
//   call      one layer's call: run() = attention kernel + combine kernel
//             (which only waits for the attention kernel when no row was
//             split); this is the number that compares with FlashMLA's
//   plan      the plan kernel alone (once per step and layer type)
//   plan+call both, back to back (a step with a single layer of the type)
//   kernel    which kernel run() took: the decode kernel (few tokens, short
//             rows; its splits a row) or the tile kernel; for decode rows
//             "tiles us" is the same call forced onto the tile kernel
// Modes: --quick (batches 1 and 128), --diag (see diagnose), --diag-decode (see
// diagnose_decode), --decode-variants (see decode_variants), --profile B H EXTRA PAGE
// (one configuration, three calls, for Nsight Compute); any of them followed
// by --single-cta runs H = 128 on one CTA per head block instead of pairs;
// --warps N: --diag-decode on the decode kernel's N-warp instantiation.
// Data: random pages (no NaN codes, realistic scales), each request with its
// own pages in a random order: SWA window of 128 over 3 pages; C4A (page 64)
// top-k picked at random among 16384 compressed entries; C128A (page 2) all
// entries in order. q random bf16, sink random.
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

#include "attn/cuda/sparse_attention_cuda.h"
#include "attn/cuda/sparse_mla_internal.cuh"
#include "cache/fp8_ds_mla.h"

#include "bench_util.cuh"

namespace {

// --single-cta: H = 128 without clusters, for comparison (a run option, not
// process state the library reads).
bool g_single_ctas = false;
int g_decode_warps = 0;  // --warps N (--diag-decode): 0, the automatic choice

constexpr int kReps = 20;
constexpr double kPeakFlops = dsv4::bench::kPeakBf16;
using dsv4::bench::kPeakBytes;

// Fills every entry of a pool of fp8_ds_mla pages with plausible data.
__global__ void fill_pages(uint8_t* base, int64_t entries, int per_page, size_t stride, uint64_t seed) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= entries) return;
  uint8_t* page = base + size_t(i / per_page) * stride;
  const int t = int(i % per_page);
  uint8_t* data = page + size_t(576) * t;
  for (int k = 0; k < 448; k += 4) {
    uint32_t w = dsv4::bench::mix32(seed ^ (uint64_t(i) << 12) ^ uint64_t(k));
    for (int b = 0; b < 4; ++b) {
      uint8_t c = uint8_t(w >> (8 * b));
      if ((c & 0x7f) == 0x7f) c ^= 1;  // no NaN codes
      data[k + b] = c;
    }
  }
  for (int k = 0; k < 64; ++k) {  // bf16 in +-[0.5, 2)
    const uint32_t r = dsv4::bench::mix32(seed ^ (uint64_t(i) << 12) ^ uint64_t(1000 + k));
    const uint16_t bits = uint16_t(((r & 1) << 15) | ((126 + ((r >> 1) & 1)) << 7) | ((r >> 2) & 0x7f));
    data[448 + 2 * k] = uint8_t(bits);
    data[449 + 2 * k] = uint8_t(bits >> 8);
  }
  uint8_t* sc = page + size_t(576) * per_page + size_t(8) * t;
  for (int b = 0; b < 7; ++b) sc[b] = uint8_t(117 + dsv4::bench::mix32(seed ^ (uint64_t(i) << 12) ^ uint64_t(2000 + b)) % 7);
  sc[7] = 0;
}

__global__ void fill_bf16(uint16_t* q, size_t n, uint64_t seed) {
  const size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const uint32_t r = dsv4::bench::mix32(seed ^ i);
  q[i] = uint16_t(((r & 1) << 15) | ((125 + ((r >> 1) % 3)) << 7) | ((r >> 3) & 0x7f));
}

__global__ void count_nan(const uint16_t* o, size_t n, unsigned long long* nans) {
  const size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n && (o[i] & 0x7fff) > 0x7f80) atomicAdd(nans, 1ull);
}

struct Pool {
  int per_page = 64;
  int64_t pages = 0;
  uint8_t* base = nullptr;
  size_t stride() const { return dsv4::fp8_ds_mla_page_stride(per_page); }
};

Pool make_pool(int per_page, int64_t pages, uint64_t seed) {
  Pool p;
  p.per_page = per_page;
  p.pages = pages;
  CHECK(cudaMalloc(&p.base, size_t(pages) * p.stride()));
  const int64_t entries = pages * per_page;
  fill_pages<<<unsigned((entries + 255) / 256), 256>>>(p.base, entries, per_page, p.stride(), seed);
  CHECK(cudaGetLastError());
  return p;
}

template <typename T>
T* upload(const std::vector<T>& v) {
  T* d = nullptr;
  CHECK(cudaMalloc(&d, std::max<size_t>(1, v.size() * sizeof(T))));
  CHECK(cudaMemcpy(d, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice));
  return d;
}

struct Problem {
  int tokens = 0, heads = 0, extra = 0, page = 0;
  Pool swa, ext;
  std::vector<void*> owned;
  dsv4::SparseAttentionParams p;
  size_t out_elems = 0;
};

// Decode: token b = request b. prefill_window: the tokens are consecutive
// positions of one request (each with its own window and selection).
Problem make_problem(int tokens, int heads, int extra, int page, bool prefill, uint64_t seed) {
  Problem pr;
  pr.tokens = tokens;
  pr.heads = heads;
  pr.extra = extra;
  pr.page = page;
  std::mt19937_64 rng(seed);
  // SWA: decode requests own 3 pages each; a prefill chunk owns its span.
  const int64_t swa_pages = prefill ? (tokens + 127) / 64 + 2 : 3 * int64_t(tokens);
  pr.swa = make_pool(64, swa_pages, seed + 1);
  std::vector<int64_t> perm(swa_pages);
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), rng);
  std::vector<int32_t> swa_idx(size_t(tokens) * 128), swa_len(tokens, 128);
  for (int t = 0; t < tokens; ++t) {
    for (int i = 0; i < 128; ++i) {
      // Request-local position of window entry i; pages of the request in perm.
      const int64_t pos = prefill ? int64_t(t) + 128 + i - 127 : 37 + i;
      const int64_t req_page = prefill ? pos / 64 : 3 * int64_t(t) + pos / 64;
      swa_idx[size_t(t) * 128 + i] = int32_t(perm[size_t(req_page)] * 64 + pos % 64);
    }
  }
  std::vector<int32_t> ext_idx, ext_len;
  if (extra > 0) {
    // C4A (page 64): 16384 compressed entries per request, top-k at random.
    // C128A (page 2): the request's `extra` entries, all in order.
    const int64_t per_req = page == 64 ? 16384 : extra;
    const int requests = prefill ? 1 : tokens;
    const int64_t pages = requests * (per_req / page);
    pr.ext = make_pool(page, pages, seed + 2);
    std::vector<int64_t> pp(pages);
    std::iota(pp.begin(), pp.end(), 0);
    std::shuffle(pp.begin(), pp.end(), rng);
    ext_idx.resize(size_t(tokens) * extra);
    ext_len.assign(tokens, extra);
    std::vector<int32_t> pick(per_req);
    for (int t = 0; t < tokens; ++t) {
      const int r = prefill ? 0 : t;
      std::iota(pick.begin(), pick.end(), 0);
      if (page == 64)
        for (int i = 0; i < extra; ++i) std::swap(pick[i], pick[i + rng() % (per_req - i)]);
      for (int i = 0; i < extra; ++i) {
        const int64_t e = pick[i];
        ext_idx[size_t(t) * extra + i] = int32_t(pp[size_t(r * (per_req / page) + e / page)] * page + e % page);
      }
    }
  }
  auto own = [&](auto* ptr) {
    pr.owned.push_back(const_cast<void*>(static_cast<const void*>(ptr)));
    return ptr;
  };
  dsv4::SparseAttentionParams& p = pr.p;
  p.num_tokens = tokens;
  p.num_heads = heads;
  pr.out_elems = size_t(tokens) * heads * 512;
  uint16_t* q = nullptr;
  CHECK(cudaMalloc(&q, pr.out_elems * 2));
  fill_bf16<<<unsigned((pr.out_elems + 255) / 256), 256>>>(q, pr.out_elems, seed + 3);
  p.q = own(q);
  std::vector<float> sink(heads);
  for (auto& s : sink) s = float(int(rng() % 200) - 100) / 50.0f;
  p.attn_sink = own(upload(sink));
  p.swa_cache = dsv4::KvPages{pr.swa.base, pr.swa.pages, 64, pr.swa.stride()};
  p.swa = dsv4::IndexList{own(upload(swa_idx)), own(upload(swa_len)), 128};
  if (extra > 0) {
    p.extra_cache = dsv4::KvPages{pr.ext.base, pr.ext.pages, page, pr.ext.stride()};
    p.extra = dsv4::IndexList{own(upload(ext_idx)), own(upload(ext_len)), extra};
  }
  p.softmax_scale = 1.0f / std::sqrt(512.0f);
  uint16_t* out = nullptr;
  float* lse = nullptr;
  CHECK(cudaMalloc(&out, pr.out_elems * 2));
  CHECK(cudaMalloc(&lse, size_t(tokens) * heads * 4));
  p.out = own(out);
  p.lse = own(lse);
  CHECK(cudaDeviceSynchronize());
  return pr;
}

void free_problem(Problem& pr) {
  for (void* d : pr.owned) cudaFree(d);
  cudaFree(pr.swa.base);
  if (pr.ext.base) cudaFree(pr.ext.base);
}

// Median time of one call (µs) of `body`, captured kReps times in a graph.
template <typename F>
double time_graph(cudaStream_t s, F body, int replays = 30) {
  return dsv4::bench::graph_median_us(s, kReps, replays, [&](cudaStream_t) {
    for (int i = 0; i < kReps; ++i) body();
  });
}

struct Result {
  double call, plan, plan_call;
  int splits;    // the decode kernel's splits a row, 0: the tile kernel
  double tiles;  // with splits: the call on the tile kernel
  unsigned long long nans;
};

// Limits for a problem's calls on the tile kernel alone.
dsv4::SparseAttentionCudaLimits tile_limits(const Problem& pr) {
  dsv4::SparseAttentionCudaLimits l{pr.tokens, pr.heads, 1, g_single_ctas};
  l.decode_max_tokens = 0;
  return l;
}

// Limits that put every row of up to kDecodeMaxEntries entries on the decode
// kernel's `warps`-warp CTAs (0: its automatic choice).
dsv4::SparseAttentionCudaLimits decode_limits(const Problem& pr, int warps) {
  dsv4::SparseAttentionCudaLimits l{pr.tokens, pr.heads, 1};
  l.decode_max_entries = dsv4::cuda::kDecodeMaxEntries;
  l.decode_max_work = int64_t(pr.tokens) * dsv4::cuda::kDecodeMaxEntries;
  l.decode_warps = warps;
  return l;
}

Result measure(Problem& pr, cudaStream_t s) {
  dsv4::SparseAttentionCuda attn({pr.tokens, pr.heads, 1, g_single_ctas});
  Result r{};
  r.splits = attn.decode_splits(pr.p);
  if (r.splits > 0) {
    dsv4::SparseAttentionCuda tiles(tile_limits(pr));
    tiles.plan(pr.p, s);
    r.tiles = time_graph(s, [&] { tiles.run(pr.p, s); });
  }
  attn.plan(pr.p, s);
  r.call = time_graph(s, [&] { attn.run(pr.p, s); });
  r.plan = time_graph(s, [&] { attn.plan(pr.p, s); });
  r.plan_call = time_graph(s, [&] {
    attn.plan(pr.p, s);
    attn.run(pr.p, s);
  });
  // Sanity: after poisoning, one more call must leave no NaN (the data has none).
  CHECK(cudaMemsetAsync(const_cast<uint16_t*>(pr.p.out), 0xFF, pr.out_elems * 2, s));
  attn.run(pr.p, s);
  unsigned long long* d = nullptr;
  CHECK(cudaMalloc(&d, 8));
  CHECK(cudaMemsetAsync(d, 0, 8, s));
  count_nan<<<unsigned((pr.out_elems + 255) / 256), 256, 0, s>>>(pr.p.out, pr.out_elems, d);
  CHECK(cudaMemcpyAsync(&r.nans, d, 8, cudaMemcpyDeviceToHost, s));
  CHECK(cudaStreamSynchronize(s));
  cudaFree(d);
  return r;
}

// A --diag row: batch, heads, extra width (beside the 128 SWA entries) and page size.
struct DiagRow {
  int b, heads, extra, page;
};

// --diag: where the time of one call goes, from the kernel's diagnostics
// (AttnParams::debug_clock) of the tile kernel, also on the rows the decode
// kernel would take: per CTA the start and end of its tile loop
// (%globaltimer) and how long S, V and the producer waited at each of their
// barriers (kDebug*). Means over the CTAs that had work; the mean and the
// last loop end from the earliest start. A second table follows one CTA's
// first tile (kDebugQReady .. kDebugFinish): the median over the CTAs with
// work of each step's end, from that CTA's own start.
void diagnose(cudaStream_t s) {
  const DiagRow cfgs[] = {{1, 64, 0, 0}, {128, 64, 0, 0}, {1, 64, 1024, 2}, {128, 64, 512, 64}, {1, 64, 8192, 2}, {128, 128, 1024, 64}};
  namespace cu = dsv4::cuda;
  std::printf("\n| b | H | N | call us | CTAs | loop end us | last end us | S waited for K us | S waited for P free us |"
              " V waited for P us | V waited for K buffer us | producer waited us | V waited for its records us |\n"
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
  std::vector<std::string> firsts;  // the second table's rows
  for (const DiagRow& c : cfgs) {
    Problem pr = make_problem(c.b, c.heads, c.extra, c.page, false, 4242 + c.b);
    dsv4::SparseAttentionCuda attn(tile_limits(pr));  // the timers are the tile kernel's
    attn.plan(pr.p, s);
    const double call = time_graph(s, [&] { attn.run(pr.p, s); }, 15);
    const int g = attn.grid_size();
    constexpr int kS = cu::kDebugSlots;
    unsigned long long* d = nullptr;
    CHECK(cudaMalloc(&d, size_t(g) * kS * 8));
    std::vector<unsigned long long> h(size_t(g) * kS);
    for (int rep = 0; rep < 2; ++rep) {  // the second call is the warm one
      CHECK(cudaMemsetAsync(d, 0, size_t(g) * kS * 8, s));
      attn.set_debug_clock(d);
      attn.run(pr.p, s);
      attn.set_debug_clock(nullptr);
      CHECK(cudaStreamSynchronize(s));
    }
    CHECK(cudaMemcpy(h.data(), d, h.size() * 8, cudaMemcpyDeviceToHost));
    cudaFree(d);
    auto at = [&](int cta, int k) { return h[size_t(cta) * kS + k]; };
    unsigned long long t0 = ~0ull, tend = 0;
    int active = 0;
    for (int c2 = 0; c2 < g; ++c2)
      if (at(c2, cu::kDebugStart)) {
        t0 = std::min(t0, at(c2, cu::kDebugStart));
        tend = std::max(tend, at(c2, cu::kDebugEnd));
        ++active;
      }
    double end = 0;
    const int waits[] = {cu::kDebugConsumerWait, cu::kDebugSPFree, cu::kDebugVPReady, cu::kDebugVEmpty,
                         cu::kDebugProducerWait, cu::kDebugVStage};
    double waited[6] = {};
    for (int c2 = 0; c2 < g; ++c2)
      if (at(c2, cu::kDebugStart)) {
        end += double(at(c2, cu::kDebugEnd) - t0) / active;
        for (int i = 0; i < 6; ++i) waited[i] += double(at(c2, waits[i])) / active;
      }
    std::printf("| %d | %d | %d | %.1f | %d | %.1f | %.1f |", c.b, c.heads, 128 + c.extra, call, active, end * 1e-3,
                double(tend - t0) * 1e-3);
    for (double w : waited) std::printf(" %.1f |", w * 1e-3);
    std::printf("\n");
    char line[256];
    int n = std::snprintf(line, sizeof line, "| %d | %d | %d |", c.b, c.heads, 128 + c.extra);
    for (int k = cu::kDebugQReady; k <= cu::kDebugFinish; ++k) {
      std::vector<double> v;
      for (int c2 = 0; c2 < g; ++c2)
        if (at(c2, cu::kDebugStart) && at(c2, k))  // a CTA with work, and the step stamped
          v.push_back((double(at(c2, k)) - double(at(c2, cu::kDebugStart))) * 1e-3);
      n += std::snprintf(line + n, sizeof line - size_t(n), " %.2f |", dsv4::bench::median(std::move(v)));
    }
    firsts.push_back(line);
    free_problem(pr);
  }
  std::printf("\nThe first tile of a CTA, median us from its start (after the wait) to the end of each step:\n"
              "| b | H | N | Q in shared memory | producer's rows | S's K wait | Q K^T | P to V | S's P V |"
              " last unit stored |\n|---|---|---|---|---|---|---|---|---|---|\n");
  for (const std::string& l : firsts) std::printf("%s\n", l.c_str());
}

// --diag-decode: the decode kernel's phases (kDecode* stamps of the last of
// kReps back-to-back calls in a graph), in us from the earliest return of a
// CTA's wait; with the lists' indices read after the wait and before it
// (ListsReady).
void diagnose_decode(cudaStream_t s) {
  const DiagRow cfgs[] = {{1, 64, 0, 0}, {1, 64, 64, 64}, {1, 64, 512, 64}, {1, 128, 512, 64}, {8, 64, 0, 0}, {8, 64, 512, 64}};
  namespace cu = dsv4::cuda;
  std::printf("\n| b | H | N | lists ready | call us | CTAs | first entry | median wait | last wait | stored | looped |"
              " merging | written (median) | written (last) |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
  for (const DiagRow& c : cfgs) {
    for (const bool ready : {false, true}) {
      Problem pr = make_problem(c.b, c.heads, c.extra, c.page, false, 4343 + c.b);
      dsv4::SparseAttentionCuda attn(decode_limits(pr, g_decode_warps));
      const int splits = attn.decode_splits(pr.p);
      if (splits == 0) continue;
      const int ctas = splits * ((c.heads + 15) / 16) * c.b;
      const dsv4::ListsReady lr{ready, ready};
      attn.plan(pr.p, s);
      const double call = time_graph(s, [&] { attn.run(pr.p, s, 0, {}, lr); }, 15);
      unsigned long long* d = nullptr;
      CHECK(cudaMalloc(&d, size_t(ctas) * cu::kDebugSlots * 8));
      CHECK(cudaMemset(d, 0, size_t(ctas) * cu::kDebugSlots * 8));
      attn.set_debug_clock(d);
      time_graph(s, [&] { attn.run(pr.p, s, 0, {}, lr); }, 3);
      attn.set_debug_clock(nullptr);
      std::vector<unsigned long long> h(size_t(ctas) * cu::kDebugSlots);
      CHECK(cudaMemcpy(h.data(), d, h.size() * 8, cudaMemcpyDeviceToHost));
      cudaFree(d);
      auto col = [&](int k) {
        std::vector<double> v;
        for (int i = 0; i < ctas; ++i) v.push_back(double(h[size_t(i) * cu::kDebugSlots + k]));
        std::sort(v.begin(), v.end());
        return v;
      };
      const std::vector<double> waited = col(cu::kDecodeWaited);
      const double t0 = waited.front();
      auto us = [&](double ns) { return (ns - t0) * 1e-3; };
      auto med = [&](int k) { return us(col(k)[size_t(ctas) / 2]); };
      std::printf("| %d | %d | %d | %s | %.1f | %d | %.2f | %.2f | %.2f | %.2f | %.2f | %.2f | %.2f | %.2f |\n", c.b, c.heads,
                  128 + c.extra, ready ? "yes" : "no", call, ctas, us(col(cu::kDecodeEntry).front()), med(cu::kDecodeWaited),
                  us(waited.back()), med(cu::kDecodeStored), med(cu::kDecodeLooped), med(cu::kDecodeMerging),
                  med(cu::kDecodeWritten), us(col(cu::kDecodeWritten).back()));
      std::fflush(stdout);
      free_problem(pr);
    }
  }
}

// --decode-variants: decode-sized calls (H = 64, 128 window entries plus
// 0-896 extra on pages of 64) on the tile kernel and on each of the decode
// kernel's instantiations (4, 8 and 16 warps a CTA), µs a call: the table
// behind SparseAttentionCuda::decode_warps' choice.
void decode_variants(cudaStream_t s) {
  std::printf("\n| b | N | tiles us | 4 warps us (splits) | 8 warps us (splits) | 16 warps us (splits) |\n"
              "|---|---|---|---|---|---|\n");
  for (const int b : {1, 2, 4, 8, 16}) {
    for (const int extra : {0, 64, 256, 512, 896}) {
      Problem pr = make_problem(b, 64, extra, 64, false, 4545 + b + extra);
      dsv4::SparseAttentionCuda tiles(tile_limits(pr));
      tiles.plan(pr.p, s);
      std::printf("| %d | %d | %.1f |", b, 128 + extra, time_graph(s, [&] { tiles.run(pr.p, s); }));
      for (const int warps : {4, 8, 16}) {
        dsv4::SparseAttentionCuda attn(decode_limits(pr, warps));
        attn.plan(pr.p, s);
        std::printf(" %.1f (%d) |", time_graph(s, [&] { attn.run(pr.p, s); }), attn.decode_splits(pr.p));
      }
      std::printf("\n");
      std::fflush(stdout);
      free_problem(pr);
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  const bool quick = argc > 1 && std::strcmp(argv[1], "--quick") == 0;
  const bool diag = argc > 1 && std::strcmp(argv[1], "--diag") == 0;
  const bool diag_decode = argc > 1 && std::strcmp(argv[1], "--diag-decode") == 0;
  const bool variants = argc > 1 && std::strcmp(argv[1], "--decode-variants") == 0;
  for (int i = 1; i < argc; ++i) {  // --single-cta (after any mode): H = 128 without clusters, for comparison
    if (std::strcmp(argv[i], "--single-cta") == 0) g_single_ctas = true;
    if (std::strcmp(argv[i], "--warps") == 0 && i + 1 < argc) g_decode_warps = std::atoi(argv[++i]);  // --diag-decode's CTAs
  }
  cudaDeviceProp prop{};
  CHECK(cudaGetDeviceProperties(&prop, 0));
  std::printf("device: %s, %d SMs, L2 %d MB\n", prop.name, prop.multiProcessorCount, prop.l2CacheSize >> 20);
  cudaStream_t s;
  CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  if (diag) {
    diagnose(s);
    return 0;
  }
  if (diag_decode) {
    diagnose_decode(s);
    return 0;
  }
  if (variants) {
    decode_variants(s);
    return 0;
  }
  if (argc >= 6 && std::strcmp(argv[1], "--profile") == 0) {
    // --profile B H EXTRA PAGE: plan once and run three default calls, for ncu
    // (e.g. --kernel-name regex:sparse_mla_kernel --launch-skip 2 --launch-count 1).
    Problem pr = make_problem(std::atoi(argv[2]), std::atoi(argv[3]), std::atoi(argv[4]), std::atoi(argv[5]), false, 99);
    dsv4::SparseAttentionCuda attn({pr.tokens, pr.heads, 1, g_single_ctas});
    attn.plan(pr.p, s);
    for (int i = 0; i < 3; ++i) attn.run(pr.p, s);
    CHECK(cudaStreamSynchronize(s));
    free_problem(pr);
    return 0;
  }
  struct Row {
    int heads, extra, page;
    double flashmla[4];
  };
  const Row rows[] = {{64, 0, 0, {10.6, 10.8, 11.1, 12.5}},
                      {64, 512, 64, {12.4, 14.1, 40.2, 40.8}},
                      {128, 1024, 64, {14.2, 19.6, 52.1, 103.1}},
                      {64, 1024, 2, {13.8, 16.3, 58.0, 71.2}},
                      {64, 8192, 2, {27.4, 46.2, 244.4, 458.8}}};
  const int batches[] = {1, 8, 64, 128};
  std::printf("\n| H | N = 128 + extra | page | b | call us | plan us | plan+call us | FlashMLA us |"
              " call / FlashMLA | TFLOP/s | GB/s | roofline us | NaN | kernel | tiles us |\n");
  std::printf("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
  for (const Row& row : rows) {
    for (int bi = 0; bi < 4; ++bi) {
      const int b = batches[bi];
      if (quick && b != 1 && b != 128) continue;
      Problem pr = make_problem(b, row.heads, row.extra, row.page, false, 1000 + b * 7 + row.extra);
      const Result r = measure(pr, s);
      const double n = 128.0 + row.extra;
      const double flops = 2.0 * row.heads * n * 1024.0 * b, bytes = n * 584.0 * b;
      const double best = r.call;
      const double roof = std::max(flops / kPeakFlops, bytes / kPeakBytes) * 1e6;
      const std::string kernel = r.splits ? "decode (" + std::to_string(r.splits) + ")" : "tiles";
      char tiles[32] = "-";
      if (r.splits) std::snprintf(tiles, sizeof tiles, "%.1f", r.tiles);
      std::printf("| %d | 128 + %d | %s | %d | %.1f | %.1f | %.1f | %.1f | %.2f | %.0f | %.0f | %.1f | %llu | %s | %s |\n",
                  row.heads, row.extra, row.extra ? std::to_string(row.page).c_str() : "-", b, best, r.plan,
                  r.plan_call, row.flashmla[bi], best / row.flashmla[bi], flops / best * 1e-6, bytes / best * 1e-3,
                  roof, r.nans, kernel.c_str(), tiles);
      std::fflush(stdout);
      free_problem(pr);
    }
  }
  // Prefill: one chunk of 4096 tokens, H = 64, window 128 + top-512 (page 64).
  {
    Problem pr = make_problem(4096, 64, 512, 64, true, 77);
    const Result r = measure(pr, s);
    const double n = 640.0, flops = 2.0 * 64 * n * 1024.0 * 4096, bytes = n * 584.0 * 4096;
    const double best = r.call;
    std::printf("\nprefill T=4096 H=64 N=128+512 page 64: call %.1f us, plan %.1f us, plan+call %.1f us, "
                "%.0f TFLOP/s, %.0f GB/s, roofline %.1f us, NaN %llu\n",
                best, r.plan, r.plan_call, flops / best * 1e-6, bytes / best * 1e-3,
                std::max(flops / kPeakFlops, bytes / kPeakBytes) * 1e6, r.nans);
    free_problem(pr);
  }
  cudaStreamDestroy(s);
  return 0;
}
