// Times the fused elementwise ops at Flash sizes (q_lora 1024, 64 heads,
// hidden 4096; C4A main compressor m = 4, c = 512; its indexer compressor
// c = 128 with MXFP4 keys; C128A m = 128) for T = 1, 8, 128 and 8192 tokens,
// against the time their bytes take at 4.3 TB/s.
//
// Every number is a median over graph replays: CUDA events around one replay
// of a graph holding `launches` back-to-back calls, divided by `launches`. The
// calls rotate over R copies of all buffers (R x bytes >= 256 MB, R <= 64), so
// large steps stream from HBM rather than L2; small steps stay latency-bound
// whatever their data (a launch costs ~2 us of latency at T = 1).
// Data: random bf16/fp32 values, no NaN. Decode steps (T = 1, 8): one token
// per request, every token at a position that completes a compressed entry
// (the compressors' worst case). Prefill steps (T = 128, 8192): one chunk of
// one request from position 0 (an entry every m tokens).
// Bytes: each kernel's compulsory reads and writes (inputs, outputs, the
// cache records, the pooled state rows of earlier steps: before the
// sixty-seventh session every pooled row counted; the state rows a later
// token reads: before the sixty-eighth every token's, as the block manager
// then gave every state block a page); FLOPs: the arithmetic, for reference
// (all these ops are bandwidth-bound).
// --stamps: only the C128A entry at one decode token, with its phases
// (wide_stamps below). --span-stamps T [SPAN]: only C128A's kRuns kernel at
// T tokens, its clusters' phases (span_stamps below). --qkv-per-cta N: the q/kv kernel's tokens a CTA.
// --only TEXT: only the rows whose kernel name contains TEXT (for ncu).
// --comp-span N: prefill compressors' tokens a CTA (set_compressor_span_tokens;
// -1: the two kernels); --comp-one-cta: with --comp-span N, C128A's on the
// one-CTA kernel instead of clusters; --comp-quad-from N: C4A's on the quad
// kernel from N tokens (set_compressor_quad_from; 0: at every size).
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "attn/compressor_params.h"
#include "attn/cuda/compressor_cuda.h"
#include "attn/cuda/out_rope.h"
#include "attn/cuda/q_head_norm_rope.h"
#include "attn/cuda/qkv_norm_rope.h"
#include "attn/cuda/residual_norm.h"
#include "cache/fp8_ds_mla.h"
#include "cache/index_key_format.h"
#include "numerics/rope.h"

#include "bench_util.cuh"

namespace {

using dsv4::bench::kPeakBytes;
constexpr double kRotateBytes = 256e6;
constexpr int kMinLaunches = 20;
constexpr int kMaxCopies = 64;

constexpr int kQLora = 1024, kHeads = 64, kHidden = 4096;

// ---- device data ------------------------------------------------------------

// bf16 in +-[2^-4, 2^4).
__global__ void fill_bf16(uint16_t* p, size_t n, uint64_t seed) {
  for (size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    const uint32_t r = dsv4::bench::mix32(seed ^ (uint64_t(i) << 8));
    p[i] = uint16_t(((r & 1) << 15) | ((123 + (r >> 1) % 8) << 7) | ((r >> 4) & 0x7f));
  }
}

// fp32 in +-[0.25, 4).
__global__ void fill_f32(float* p, size_t n, uint64_t seed) {
  for (size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    const uint32_t r = dsv4::bench::mix32(seed ^ (uint64_t(i) << 8));
    p[i] = __uint_as_float(((r & 1) << 31) | ((125 + (r >> 1) % 4) << 23) | ((r >> 3) & 0x7fffff));
  }
}

// Owns device allocations.
struct Mem {
  std::vector<void*> ptrs;
  Mem() = default;
  Mem(const Mem&) = delete;
  ~Mem() {
    for (void* p : ptrs) cudaFree(p);
  }
  template <typename T>
  T* alloc(size_t n) {
    void* p = nullptr;
    CHECK(cudaMalloc(&p, std::max<size_t>(n, 1) * sizeof(T)));
    ptrs.push_back(p);
    return static_cast<T*>(p);
  }
  template <typename T>
  T* upload(const std::vector<T>& v) {
    T* p = alloc<T>(v.size());
    CHECK(cudaMemcpy(p, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice));
    return p;
  }
  uint16_t* bf16(size_t n, uint64_t seed) {
    uint16_t* p = alloc<uint16_t>(n);
    fill_bf16<<<1024, 256>>>(p, n, seed);
    CHECK(cudaGetLastError());
    return p;
  }
  float* f32(size_t n, uint64_t seed) {
    float* p = alloc<float>(n);
    fill_f32<<<1024, 256>>>(p, n, seed);
    CHECK(cudaGetLastError());
    return p;
  }
  uint8_t* bytes(size_t n) {
    uint8_t* p = alloc<uint8_t>(n);
    CHECK(cudaMemset(p, 0, n));
    return p;
  }
};

const dsv4::Rope& rope() {
  static const dsv4::Rope r(dsv4::RopeParams{160000, true, dsv4::YarnParams{}});
  return r;
}

// Positions of a step: decode (T <= 8): request t at a position completing
// an entry of every ratio (p + 1 a multiple of 128); prefill: 0 .. T-1.
bool decode_step(int T) { return T <= 8; }
int64_t position(int T, int t) { return decode_step(T) ? 1048575 - 128 * int64_t(t) : t; }

// One set of buffers and the call on them.
struct Instance {
  Mem mem;
  std::function<void(cudaStream_t)> run;
};

struct Case {
  std::string name;
  int T = 0;
  double bytes = 0, flops = 0;
  std::function<void(Instance&, uint64_t)> make;
};

// The step's table of the rotation's factors for T positions (built once in
// make, outside the timed calls), as the engine passes it to the kernels.
const float* rope_table(Instance& in, const int32_t* positions, int T) {
  float* cs = in.mem.alloc<float>(size_t(T) * 64);
  dsv4::cuda::out_rope_table_cuda(positions, T, rope(), cs, nullptr);
  CHECK(cudaDeviceSynchronize());
  return cs;
}

// ---- the ops ------------------------------------------------------------------

// per_cta: tokens a CTA (0: the launcher's choice).
Case qkv_case(int T, int per_cta) {
  const int W = kQLora + 512;
  Case c{"qkv_norm_rope", T, 0, 0, {}};
  // As the layer calls it: cq in its FP8 form only (no bf16 copy).
  c.bytes = double(T) * (W * 2 + 8 + 4 + kQLora + kQLora / 128 * 4 + 584) + W * 4.0;
  c.flops = double(T) * (W * 5 + 64 * 3);
  c.make = [T, W, per_cta](Instance& in, uint64_t seed) {
    dsv4::cuda::QkvNormRopeParams p;
    p.num_tokens = T;
    p.q_lora = kQLora;
    p.qkv = in.mem.bf16(size_t(T) * W, seed);
    p.qkv_ld = W;
    p.q_norm = in.mem.f32(kQLora, seed + 1);
    p.kv_norm = in.mem.f32(512, seed + 2);
    std::vector<int32_t> pos(static_cast<size_t>(T));
    std::vector<int32_t> slot(static_cast<size_t>(T));
    for (int t = 0; t < T; ++t) pos[size_t(t)] = position(T, t), slot[size_t(t)] = t;
    p.positions = in.mem.upload(pos);
    p.rope = &rope();
    p.cq_fp8 = dsv4::cuda::Fp8ActOut{in.mem.alloc<uint8_t>(size_t(T) * kQLora),
                                     in.mem.alloc<float>(size_t(T) * kQLora / 128), T, kQLora, kQLora, T};
    const int64_t pages = (T + 63) / 64;
    p.swa = dsv4::KvPagesMut{in.mem.bytes(size_t(pages) * dsv4::fp8_ds_mla_page_stride(64)), pages, 64,
                             dsv4::fp8_ds_mla_page_stride(64)};
    p.swa_slot = in.mem.upload(slot);
    p.tokens_per_cta = per_cta;
    in.run = [p](cudaStream_t s) { dsv4::cuda::qkv_norm_rope_cuda(p, s); };
  };
  return c;
}

// table: the rotation's factors read from the step's table, as the engine
// runs it.
Case q_head_case(int T, bool table) {
  Case c{table ? "q_head, table" : "q_head_norm_rope", T, 0, 0, {}};
  c.bytes = double(T) * (kHeads * 512 * 2 * 2 + 8);
  c.flops = double(T) * kHeads * (512 * 4 + 64 * 3);
  c.make = [T, table](Instance& in, uint64_t seed) {
    dsv4::cuda::QHeadNormRopeParams p;
    p.num_tokens = T;
    p.num_heads = kHeads;
    p.q = in.mem.bf16(size_t(T) * kHeads * 512, seed);
    p.q_ld = kHeads * 512;
    std::vector<int32_t> pos(static_cast<size_t>(T));
    for (int t = 0; t < T; ++t) pos[size_t(t)] = position(T, t);
    p.positions = in.mem.upload(pos);
    p.rope = &rope();
    if (table) p.rope_table = rope_table(in, p.positions, T);
    in.run = [p](cudaStream_t s) { dsv4::cuda::q_head_norm_rope_cuda(p, s); };
  };
  return c;
}

Case out_rope_case(int T) {
  Case c{"out_inverse_rope", T, 0, 0, {}};
  c.bytes = double(T) * (kHeads * 64 * 2 * 2 + 8);
  c.flops = double(T) * kHeads * 64 * 3;
  c.make = [T](Instance& in, uint64_t seed) {
    dsv4::cuda::OutInverseRopeParams p;
    p.num_tokens = T;
    p.num_heads = kHeads;
    p.o = in.mem.bf16(size_t(T) * kHeads * 512, seed);
    p.o_ld = kHeads * 512;
    std::vector<int32_t> pos(static_cast<size_t>(T));
    for (int t = 0; t < T; ++t) pos[size_t(t)] = position(T, t);
    p.positions = in.mem.upload(pos);
    p.rope = &rope();
    in.run = [p](cudaStream_t s) { dsv4::cuda::out_inverse_rope_cuda(p, s); };
  };
  return c;
}

Case residual_case(int T) {
  Case c{"residual_norm", T, 0, 0, {}};
  c.bytes = double(T) * kHidden * (4 + 2 + 4 + 2 + 1 + 4.0 / 128);
  c.flops = double(T) * kHidden * 5;
  c.make = [T](Instance& in, uint64_t seed) {
    dsv4::cuda::ResidualNormParams p;
    p.mode = dsv4::cuda::ResidualMode::kAddNorm;
    p.num_tokens = T;
    p.dim = kHidden;
    p.h = in.mem.f32(size_t(T) * kHidden, seed);
    p.h_ld = kHidden;
    p.y = in.mem.bf16(size_t(T) * kHidden, seed + 1);
    p.y_ld = kHidden;
    p.x = in.mem.alloc<uint16_t>(size_t(T) * kHidden);
    p.x_ld = kHidden;
    p.x_fp8 = dsv4::cuda::Fp8ActOut{in.mem.alloc<uint8_t>(size_t(T) * kHidden),
                                    in.mem.alloc<float>(size_t(T) * kHidden / 128), T, kHidden, kHidden, T};
    in.run = [p](cudaStream_t s) { dsv4::cuda::residual_norm_cuda(p, s); };
  };
  return c;
}

// One compressor: ratio m, entry dim c, record.
Case compressor_case(const std::string& name, int T, int m, int cdim, dsv4::EntryFormat record) {
  const int kc = (m == 4 ? 2 : 1) * cdim, row = 2 * kc, Bs = m == 4 ? 4 : 128;
  const int Bo = record == dsv4::EntryFormat::kFp8DsMla && m == 128 ? 2 : 64;
  const int record_bytes = record == dsv4::EntryFormat::kFp8DsMla    ? 584
                           : record == dsv4::EntryFormat::kIndexFp8 ? 132
                                                                          : 68;
  // Pooled rows that earlier steps wrote are read from the state cache; the
  // step's own rows come from the projection it reads anyway. A prefill
  // chunk's state blocks have pages only where a later token reads them
  // (CacheSpec::needs_page: the blocks from first_live on).
  const int64_t first_live = decode_step(T) ? 0 : m == 4 ? std::max(0, T / 4 - 1) : T / 128;
  int entries = 0;
  double earlier_rows = 0, kept_rows = 0;
  for (int t = 0; t < T; ++t) {
    const int64_t pos = position(T, t);
    kept_rows += pos / Bs >= first_live;
    if ((pos + 1) % m != 0) continue;
    ++entries;
    const int64_t j = (pos + 1) / m - 1, first = m == 4 ? std::max<int64_t>(0, (j - 1) * m) : j * m;
    earlier_rows += double(std::max<int64_t>(0, (decode_step(T) ? pos : 0) - first));
  }
  const int pooled = m == 4 ? 8 : 128;
  Case c{name, T, 0, 0, {}};
  c.bytes = double(T) * (row * 4.0 + 8 + 12) + kept_rows * row * 4.0 + double(m) * kc * 4 +
            earlier_rows * 2 * cdim * 4 + double(entries) * (record_bytes + cdim * 4);
  c.flops = double(T) * kc + double(entries) * cdim * (pooled * 20.0 + 10);
  c.make = [=](Instance& in, uint64_t seed) {
    dsv4::CompressorParams p;
    p.num_tokens = T;
    p.ratio = m;
    p.dim = cdim;
    p.proj = in.mem.f32(size_t(T) * row, seed);
    p.proj_ld = row;
    p.a_col = 0;
    p.ape = in.mem.f32(size_t(m) * kc, seed + 1);
    p.norm = in.mem.f32(size_t(cdim), seed + 2);
    p.rope = &rope();
    // Every request's blocks on their own pages: decode requests own the
    // pages of the rows they pool, the prefill chunk all of its blocks.
    const int requests = decode_step(T) ? T : 1;
    std::vector<int32_t> pos(static_cast<size_t>(T));
    std::vector<int32_t> run(static_cast<size_t>(T)), row_slot(static_cast<size_t>(T)),
        entry_slot(static_cast<size_t>(T));
    int width = 0;
    std::vector<int32_t> first(static_cast<size_t>(requests));
    for (int r = 0; r < requests; ++r) {
      const int64_t lo = decode_step(T) ? std::max<int64_t>(0, position(T, r) - pooled) : 0;
      const int64_t hi = decode_step(T) ? position(T, r) : T - 1;
      first[size_t(r)] = int32_t(lo / Bs);
      width = std::max<int>(width, int(hi / Bs - lo / Bs + 1));
    }
    std::vector<int32_t> pages(size_t(requests) * size_t(width));
    for (size_t i = 0; i < pages.size(); ++i) pages[i] = int32_t(i);
    const int64_t state_pages = int64_t(pages.size());
    int64_t next_out = 0;
    for (int t = 0; t < T; ++t) {
      const int r = decode_step(T) ? t : 0;
      pos[size_t(t)] = position(T, t);
      run[size_t(t)] = r;
      const int64_t block = pos[size_t(t)] / Bs;
      int32_t& page = pages[size_t(r) * size_t(width) + size_t(block - first[size_t(r)])];
      if (block < first_live) page = -1;  // no page: the entries pool these rows from the projection
      row_slot[size_t(t)] = page < 0 ? -1 : int32_t(page * int64_t(Bs) + pos[size_t(t)] % Bs);
      entry_slot[size_t(t)] = (pos[size_t(t)] + 1) % m == 0 ? int32_t(next_out++) : -1;
    }
    p.positions = in.mem.upload(pos);
    p.token_run = in.mem.upload(run);
    p.row_slot = in.mem.upload(row_slot);
    p.entry_slot = in.mem.upload(entry_slot);
    p.state_table = dsv4::BlockTableView{in.mem.upload(pages), in.mem.upload(first), width, Bs};
    const size_t s_stride = size_t(row) * 4 * size_t(Bs);
    p.state = dsv4::KvPagesMut{reinterpret_cast<uint8_t*>(in.mem.f32(size_t(state_pages) * row * Bs, seed + 3)),
                               state_pages, Bs, s_stride};
    const int64_t out_pages = next_out / Bo + 1;
    const size_t o_stride = dsv4::entry_page_stride(record, Bo, cdim);
    p.out = dsv4::KvPagesMut{in.mem.bytes(size_t(out_pages) * o_stride), out_pages, Bo, o_stride};
    p.record = record;
    p.hadamard = cdim == 128;
    // Steps launch as the engine launches them.
    const auto mode =
        decode_step(T) ? dsv4::cuda::CompressorLaunch::kOneTokenPerRun : dsv4::cuda::CompressorLaunch::kRuns;
    in.run = [p, mode](cudaStream_t s) { dsv4::cuda::compressor_cuda(p, s, mode); };
  };
  return c;
}

// ---- timing -------------------------------------------------------------------

using Instances = std::vector<std::unique_ptr<Instance>>;

// The case's R buffer copies (R x bytes >= kRotateBytes, R <= kMaxCopies), made.
Instances make_instances(const Case& c) {
  const int copies = std::clamp(int(std::ceil(kRotateBytes / std::max(c.bytes, 1.0))), 1, kMaxCopies);
  Instances inst;
  for (int i = 0; i < copies; ++i) {
    inst.push_back(std::make_unique<Instance>());
    c.make(*inst.back(), 1000 + 17 * uint64_t(i));
  }
  CHECK(cudaDeviceSynchronize());
  return inst;
}

// The calls a timing graph holds.
int launches_for(const Instances& inst) { return std::max<int>(kMinLaunches, int(inst.size())); }

// Median µs of one call over graph replays; the calls rotate over the
// instances. before_call(i), if given, runs on the host before call i is
// captured.
double time_calls(Instances& inst, cudaStream_t s, const std::function<void(int)>& before_call = nullptr) {
  const int launches = launches_for(inst);
  return dsv4::bench::graph_median_us(s, launches, 25, [&](cudaStream_t st) {
    for (int i = 0; i < launches; ++i) {
      if (before_call) before_call(i);
      inst[size_t(i) % inst.size()]->run(st);
    }
  });
}

std::string g_only;  // --only TEXT: the cases whose name contains TEXT

void run_case(const Case& c, cudaStream_t s) {
  if (c.name.find(g_only) == std::string::npos) return;
  Instances inst = make_instances(c);
  const double us = time_calls(inst, s);
  const double roof = c.bytes / kPeakBytes * 1e6;
  std::printf("%-20s %5d %10.2f %11.3f %9.4f %10.2f %7.2f %4d\n", c.name.c_str(), c.T, us, c.bytes / 1e6,
              c.flops / 1e9, roof, us / roof, int(inst.size()));
  std::fflush(stdout);
}

// The calls of time_calls (*us: its median), each launch of C128A's cluster
// kernels with its own stamp buffer of `per` points (set_compressor_wide_stamps
// is read at launch, so each captured launch keeps its pointer): the stamps
// of launch l at [per * l, per * (l + 1)).
std::vector<unsigned long long> stamped_calls(Instances& inst, cudaStream_t s, size_t per, double* us) {
  const int launches = launches_for(inst);
  Mem mem;
  unsigned long long* buf = mem.alloc<unsigned long long>(per * size_t(launches));
  CHECK(cudaMemset(buf, 0, per * size_t(launches) * sizeof(unsigned long long)));
  CHECK(cudaDeviceSynchronize());
  *us = time_calls(inst, s, [&](int i) { dsv4::cuda::set_compressor_wide_stamps(buf + per * size_t(i)); });
  dsv4::cuda::set_compressor_wide_stamps(nullptr);
  std::vector<unsigned long long> h(per * size_t(launches));
  CHECK(cudaMemcpy(h.data(), buf, h.size() * sizeof(unsigned long long), cudaMemcpyDeviceToHost));
  return h;
}

// --stamps: the C128A cluster kernel's phases at one decode token (the
// compressor c128a row of T = 1), from its stamped instantiation
// (set_compressor_wide_stamps). The graph of the timing holds `launches`
// calls, each captured with its own stamp buffer; per launch every point is
// taken from the earliest return of the PDL wait among its 8 CTAs (when the
// previous call's results were visible), and the table gives the median over
// launches of the CTAs' median and latest times.
void wide_stamps(cudaStream_t s) {
  using dsv4::cuda::kWideStampCount;
  using dsv4::cuda::kWideSplit;
  Instances inst = make_instances(compressor_case("compressor c128a", 1, 128, 512, dsv4::EntryFormat::kFp8DsMla));
  constexpr int kCtas = kWideSplit;  // one token's cluster
  const int launches = launches_for(inst);
  const size_t per = size_t(kCtas) * kWideStampCount;
  double us = 0;
  const std::vector<unsigned long long> h = stamped_calls(inst, s, per, &us);
  using dsv4::bench::median;
  std::printf("c128a entry, stamped: %.2f us a call (%d launches a graph)\n", us, launches);
  std::printf("| point | median of CTAs' median us | median of latest us |\n|---|---|---|\n");
  for (int pt = 0; pt < kWideStampCount; ++pt) {
    std::vector<double> med, last;
    for (int l = 0; l < launches; ++l) {
      const unsigned long long* at = h.data() + per * size_t(l);
      unsigned long long t0 = ~0ull;
      for (int c = 0; c < kCtas; ++c) t0 = std::min(t0, at[c * kWideStampCount + 1]);
      std::vector<double> v;
      for (int c = 0; c < kCtas; ++c) v.push_back((double(at[c * kWideStampCount + pt]) - double(t0)) * 1e-3);
      med.push_back(median(v));
      last.push_back(*std::max_element(v.begin(), v.end()));
    }
    std::printf("| %s | %.2f | %.2f |\n", dsv4::cuda::kWideStampNames[pt], median(med), median(last));
  }
  std::fflush(stdout);
}

// --span-stamps T [SPAN]: the C128A kRuns cluster kernel at T tokens (spans
// of SPAN tokens; default the launcher's rule, compressor_c128a_span) with
// its phases stamped (kSpanWideStampNames). Every cluster's rank-0 points of
// one launch, the graph's middle one, from that launch's earliest entry,
// then the medians of the phases over the clusters whose span completes an
// entry: where a long step's time goes (waves of resident clusters, each
// entry's chain of phases).
void span_stamps(cudaStream_t s, int T, int span) {
  using dsv4::cuda::kWideStampCount;
  using dsv4::cuda::kWideSplit;
  dsv4::cuda::set_compressor_span_tokens(std::max(span, 0), true);
  span = dsv4::cuda::compressor_c128a_span(T);  // what the launcher takes: the rule, or SPAN capped
  Instances inst = make_instances(compressor_case("compressor c128a", T, 128, 512, dsv4::EntryFormat::kFp8DsMla));
  const int clusters = (T + span - 1) / span, ctas = clusters * kWideSplit, launches = launches_for(inst);
  const size_t per = size_t(ctas) * kWideStampCount;
  double us = 0;
  const std::vector<unsigned long long> h = stamped_calls(inst, s, per, &us);
  dsv4::cuda::set_compressor_span_tokens(0, true);
  const unsigned long long* at = h.data() + per * size_t(launches / 2);
  unsigned long long t0 = ~0ull, last = 0;
  for (int c = 0; c < ctas; ++c) {
    t0 = std::min(t0, at[size_t(c) * kWideStampCount]);
    last = std::max(last, at[size_t(c) * kWideStampCount + kWideStampCount - 1]);
  }
  auto rel = [&](int cta, int pt) {  // us from t0; -1: not stamped
    const unsigned long long v = at[size_t(cta) * kWideStampCount + size_t(pt)];
    return v ? (double(v) - double(t0)) * 1e-3 : -1.0;
  };
  std::printf("c128a span kernel, stamped: %d tokens, spans of %d, %d clusters (%d resident at once): %.2f us a "
              "call; launch %d's last CTA done %.2f us after its first entry\n|",
              T, span, clusters, dsv4::cuda::compressor_c128a_resident_clusters(), us, launches / 2,
              (double(last) - double(t0)) * 1e-3);
  for (const char* name : dsv4::cuda::kSpanWideStampNames) std::printf(" %s |", name);
  std::printf(" latest done |\n");
  std::vector<std::vector<double>> phase(kWideStampCount - 1);
  for (int c = 0; c < clusters; ++c) {
    const int r0 = c * kWideSplit;
    double latest = 0;
    for (int r = 0; r < kWideSplit; ++r) latest = std::max(latest, rel(r0 + r, kWideStampCount - 1));
    std::printf("|");
    for (int pt = 0; pt < kWideStampCount; ++pt) std::printf(" %.2f |", rel(r0, pt));
    std::printf(" %.2f |\n", latest);
    if (rel(r0, 3) < 0) continue;  // no entry
    for (int pt = 1; pt < kWideStampCount; ++pt) phase[size_t(pt - 1)].push_back(rel(r0, pt) - rel(r0, pt - 1));
  }
  std::printf("median phase (clusters with an entry, rank 0), us, ending at:");
  for (int pt = 1; pt < kWideStampCount; ++pt)
    std::printf(" %s %.2f", dsv4::cuda::kSpanWideStampNames[pt],
                phase[size_t(pt - 1)].empty() ? 0.0 : dsv4::bench::median(phase[size_t(pt - 1)]));
  std::printf("\n");
  std::fflush(stdout);
}

}  // namespace

int main(int argc, char** argv) {
  int dev = 0;
  cudaDeviceProp prop{};
  CHECK(cudaGetDeviceProperties(&prop, dev));
  std::printf("device: %s, %d SMs, L2 %.0f MB\n", prop.name, prop.multiProcessorCount, prop.l2CacheSize / 1e6);
  std::vector<int> sizes = {1, 8, 128, 8192};
  cudaStream_t s;
  CHECK(cudaStreamCreate(&s));
  if (argc > 2 && std::string(argv[1]) == "--span-stamps") {
    const int T = std::atoi(argv[2]);
    if (T < 1) {
      std::fprintf(stderr, "fused_bench --span-stamps T [SPAN]: T must be a positive token count\n");
      CHECK(cudaStreamDestroy(s));
      return 2;
    }
    span_stamps(s, T, argc > 3 ? std::atoi(argv[3]) : 0);
    CHECK(cudaStreamDestroy(s));
    return 0;
  }
  if (argc > 1 && std::string(argv[1]) == "--stamps") {
    wide_stamps(s);
    CHECK(cudaStreamDestroy(s));
    return 0;
  }
  int qkv_per_cta = 0;  // --qkv-per-cta N: force the q/kv kernel's tokens a CTA
  int comp_span = 0, comp_quad_from = -1;
  bool comp_clusters = true;
  for (int a = 1; a < argc; ++a) {
    if (std::string(argv[a]) == "--qkv-per-cta" && a + 1 < argc)
      qkv_per_cta = std::atoi(argv[++a]);
    else if (std::string(argv[a]) == "--comp-span" && a + 1 < argc)
      comp_span = std::atoi(argv[++a]);
    else if (std::string(argv[a]) == "--comp-one-cta")  // with --comp-span: C128A without clusters
      comp_clusters = false;
    else if (std::string(argv[a]) == "--comp-quad-from" && a + 1 < argc)
      comp_quad_from = std::atoi(argv[++a]);
    else if (std::string(argv[a]) == "--only" && a + 1 < argc)
      g_only = argv[++a];
    else
      sizes = {std::atoi(argv[a])};
  }
  dsv4::cuda::set_compressor_span_tokens(comp_span, comp_clusters);
  dsv4::cuda::set_compressor_quad_from(comp_quad_from);
  std::printf("%-20s %5s %10s %11s %9s %10s %7s %4s\n", "kernel", "T", "time us", "bytes MB", "GFLOP", "bytes us",
              "ratio", "R");
  for (int T : sizes) {
    run_case(qkv_case(T, qkv_per_cta), s);
    run_case(q_head_case(T, false), s);
    run_case(q_head_case(T, true), s);
    run_case(out_rope_case(T), s);
    run_case(residual_case(T), s);
    run_case(compressor_case("compressor c4a", T, 4, 512, dsv4::EntryFormat::kFp8DsMla), s);
    run_case(compressor_case("compressor c4a idx", T, 4, 128, dsv4::EntryFormat::kIndexMxfp4), s);
    run_case(compressor_case("compressor c128a", T, 128, 512, dsv4::EntryFormat::kFp8DsMla), s);
  }
  CHECK(cudaStreamDestroy(s));
  std::printf("bytes us: the bytes at %.1f TB/s; ratio: time / bytes us; R: buffer copies rotated\n",
              kPeakBytes / 1e12);
  return 0;
}
