// Host side of the CUDA sparse attention: parameter checks, device workspace,
// plan slots and kernel launches.
#include "attn/cuda/sparse_attention_cuda.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "attn/cuda/sparse_mla_internal.cuh"
#include "cache/fp8_ds_mla.h"
#include "common/error.h"

namespace dsv4 {
namespace {

void cuda_check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw Error(std::string("sparse attention (cuda): ") + what + ": " + cudaGetErrorString(e));
}

bool aligned(const void* p, size_t a) { return reinterpret_cast<uintptr_t>(p) % a == 0; }

// What the kernel needs beyond the interface's checks: aligned index lists,
// fp8_ds_mla pages, 16-byte loads of the 576-byte records (576 = 36 * 16).
void check_cuda_list(const KvPages& cache, const IndexList& list, const std::string& what) {
  if (list.width == 0) return;
  DSV4_REQUIRE(aligned(list.indices, 4) && aligned(list.lengths, 4), what + ": misaligned index list");
  DSV4_REQUIRE(cache.page_stride >= fp8_ds_mla_page_stride(cache.entries_per_page),
          what + ": page stride smaller than an fp8_ds_mla page");
  DSV4_REQUIRE(aligned(cache.base, 16) && cache.page_stride % 16 == 0, what + ": cache base and page stride must be 16-byte aligned");
}

int head_blocks(int heads) { return (heads + cuda::kHeadBlock - 1) / cuda::kHeadBlock; }

}  // namespace

void check_sparse_attention_cuda_params(const SparseAttentionParams& p, const SparseAttentionCudaLimits& limits) {
  check_sparse_attention_params(p);
  DSV4_REQUIRE(p.num_tokens <= limits.max_tokens, "sparse attention (cuda): " + std::to_string(p.num_tokens) +
                                                 " tokens exceed the limit of " + std::to_string(limits.max_tokens));
  if (p.num_tokens == 0) return;
  DSV4_REQUIRE(p.num_heads > 0 && p.num_heads <= limits.max_heads,
          "sparse attention (cuda): num_heads must be in [1, " + std::to_string(limits.max_heads) + "]");
  DSV4_REQUIRE(aligned(p.q, 16) && aligned(p.out, 8) && aligned(p.attn_sink, 4) && aligned(p.lse, 4),
          "sparse attention (cuda): q must be 16-byte, out 8-byte, attn_sink and lse 4-byte aligned");
  check_cuda_list(p.swa_cache, p.swa, "sparse attention (cuda, swa)");
  check_cuda_list(p.extra_cache, p.extra, "sparse attention (cuda, extra)");
  // Tile numbers are 32-bit on the device.
  const int64_t tiles_per_unit = (int64_t(p.swa.width) + p.extra.width) / cuda::kTileEntries + 1;
  DSV4_REQUIRE(int64_t(p.num_tokens) * head_blocks(p.num_heads) * tiles_per_unit < (int64_t(1) << 30),
          "sparse attention (cuda): too much work for one call");
}

struct SparseAttentionCuda::Impl {
  struct PlanSlot {
    cuda::PlanView view{};
    bool built = false;
    int tokens = 0, heads = 0, swa_width = 0, extra_width = 0;
    int cluster = 1;  // chosen at plan time: the plan's work slots depend on it
  };
  SparseAttentionCudaLimits limits;
  int grid = 0;       // CTAs of one wave, one per SM
  int pair_grid = 0;  // CTAs of one wave in clusters of two (0: clusters do not fit)
  std::vector<void*> allocations;
  float* partial_o = nullptr;
  float2* partial_ml = nullptr;
  std::vector<PlanSlot> plans;
  size_t bytes = 0;
  unsigned long long* debug_clock = nullptr;

  template <typename T>
  T* alloc(size_t count) {
    void* p = nullptr;
    cuda_check(cudaMalloc(&p, count * sizeof(T)), "cudaMalloc");
    allocations.push_back(p);
    bytes += count * sizeof(T);
    return static_cast<T*>(p);
  }
  ~Impl() {
    for (void* p : allocations) cudaFree(p);
  }

  // Pairs of head blocks (H = 128) run on clusters of two CTAs, which share
  // the dequantization of every tile.
  int cluster_for(int heads) const {
    return head_blocks(heads) % 2 == 0 && pair_grid >= 2 && !limits.pairs_on_single_ctas ? 2 : 1;
  }

  cuda::AttnParams params(const SparseAttentionParams& p, const PlanSlot& slot) const {
    cuda::AttnParams a{};
    a.num_tokens = p.num_tokens;
    a.num_heads = p.num_heads;
    a.head_blocks = head_blocks(p.num_heads);
    a.cluster = slot.cluster;
    a.plan_head_blocks = a.head_blocks / a.cluster;
    a.q = p.q;
    auto cache = [](const KvPages& c, const IndexList& l) {
      cuda::CacheView v{};
      if (l.width > 0) {
        v.base = c.base;
        v.capacity = c.capacity();
        v.page_stride = int64_t(c.page_stride);
        v.entries_per_page = uint32_t(c.entries_per_page);
        v.page_shift = std::has_single_bit(v.entries_per_page) ? std::countr_zero(v.entries_per_page) : -1;
      }
      return v;
    };
    a.swa_cache = cache(p.swa_cache, p.swa);
    a.extra_cache = cache(p.extra_cache, p.extra);
    a.swa = cuda::ListView{p.swa.indices, p.swa.lengths, p.swa.width};
    a.extra = cuda::ListView{p.extra.indices, p.extra.lengths, p.extra.width};
    a.late_trigger = int64_t(p.swa.width) + p.extra.width <= cuda::kDecodeMaxEntries;
    a.sink = p.attn_sink;
    a.scale_log2 = p.softmax_scale * 1.4426950408889634f;
    a.out = p.out;
    a.lse = p.lse;
    a.plan = slot.view;
    a.partial_o = partial_o;
    a.partial_ml = partial_ml;
    a.grid = slot.cluster == 2 ? pair_grid : grid;
    a.debug_clock = debug_clock;
    return a;
  }
};

SparseAttentionCuda::SparseAttentionCuda(const SparseAttentionCudaLimits& limits) : impl_(new Impl) {
  try {
    DSV4_REQUIRE(limits.max_tokens >= 0 && limits.max_heads > 0 && limits.num_plans > 0,
            "sparse attention (cuda): bad limits");
    DSV4_REQUIRE(limits.decode_max_tokens >= 0 && limits.decode_max_tokens <= 65535,
            "sparse attention (cuda): decode_max_tokens must be in [0, 65535]");
    DSV4_REQUIRE(limits.decode_max_entries >= 0 && limits.decode_max_entries <= cuda::kDecodeMaxEntries,
            "sparse attention (cuda): decode_max_entries must be in [0, " + std::to_string(cuda::kDecodeMaxEntries) + "]");
    DSV4_REQUIRE(limits.decode_max_work >= 0, "sparse attention (cuda): negative decode_max_work");
    DSV4_REQUIRE(limits.decode_warps == 0 || limits.decode_warps == 4 || limits.decode_warps == 8 || limits.decode_warps == 16,
            "sparse attention (cuda): decode_warps must be 0 (automatic), 4, 8 or 16");
    const int dec = cuda::decode_attention_prepare();
    if (dec < 0) cuda_check(cudaError_t(-dec), "preparing the decode kernel");
    impl_->limits = limits;
    const int single = cuda::attention_grid(1), pairs = cuda::attention_grid(2);
    if (single < 0) cuda_check(cudaError_t(-single), "preparing the attention kernel");
    if (pairs < 0) cuda_check(cudaError_t(-pairs), "preparing the attention kernel (clusters)");
    DSV4_REQUIRE(single > 0, "sparse attention (cuda): the attention kernel does not fit on this device");
    // One wave: all CTAs resident together.
    impl_->grid = std::min(single, cuda::kMaxGrid);
    impl_->pair_grid = std::min(pairs, impl_->grid) & ~1;
    const int g = impl_->grid;
    impl_->partial_o = impl_->alloc<float>(size_t(g) * 2 * cuda::kHeadBlock * 512);
    impl_->partial_ml = impl_->alloc<float2>(size_t(g) * 2 * cuda::kHeadBlock);
    const size_t units = size_t(limits.max_tokens) * head_blocks(limits.max_heads);
    impl_->plans.resize(limits.num_plans);
    for (auto& s : impl_->plans) {
      s.view.unit_info = impl_->alloc<int4>(units + 1);
      s.view.cta_work = impl_->alloc<int4>(g);
      s.view.split_units = impl_->alloc<int>(size_t(g));
      s.view.split_count = impl_->alloc<int>(2);
    }
  } catch (...) {
    delete impl_;
    throw;
  }
}

SparseAttentionCuda::~SparseAttentionCuda() { delete impl_; }

void SparseAttentionCuda::set_debug_clock(unsigned long long* clock) { impl_->debug_clock = clock; }

int SparseAttentionCuda::decode_splits(const SparseAttentionParams& p) const {
  const int64_t width = int64_t(p.swa.width) + p.extra.width;
  const SparseAttentionCudaLimits& l = impl_->limits;
  if (p.num_tokens <= 0 || p.num_tokens > l.decode_max_tokens || width > l.decode_max_entries ||
      width * p.num_tokens > l.decode_max_work)
    return 0;
  // One chunk a split where the row allows it, up to the cluster's size.
  const int chunk = cuda::decode_chunk(decode_warps(p));
  return int(std::clamp<int64_t>((width + chunk - 1) / chunk, 1, cuda::kDecodeMaxSplits));
}

// Automatic: one or two tokens with rows past 256 entries (C4A's 640, C128A
// past 16K context) on CTAs of 16 warps, the fewest CTAs; the rest on 8. In
// the decode steps fewer, larger CTAs won even where the call alone is
// slower (one token, 640 entries: 9.7 us on 16 warps, 10.7 on 8, 12.4 on 4;
// 128 entries: 8.9 on 16, 7.2 on 8, yet the batch-1 step at 4K context took
// 2.93 ms with every call on 16 warps against 2.98 on 4, run AH1), probably
// because fewer CTAs wait less for the SMs that the linears before them
// hold (not measured directly). This rule and every call on 16 warps
// measured level in the steps (run AH3); it keeps the window's rows on the
// faster call alone. docs/perf-notes.md, runs AH1-AH3.
int SparseAttentionCuda::decode_warps(const SparseAttentionParams& p) const {
  const int w = impl_->limits.decode_warps;
  if (w > 0) return w;
  if (p.num_tokens > 2) return 8;
  return int64_t(p.swa.width) + p.extra.width <= 256 ? 8 : 16;
}

const SparseAttentionCudaLimits& SparseAttentionCuda::limits() const { return impl_->limits; }
int SparseAttentionCuda::grid_size() const { return impl_->grid; }
size_t SparseAttentionCuda::workspace_bytes() const { return impl_->bytes; }

void SparseAttentionCuda::plan(const SparseAttentionParams& p, CUstream_st* stream, int slot,
                               const int32_t* real_tokens) {
  DSV4_REQUIRE(slot >= 0 && slot < int(impl_->plans.size()), "sparse attention (cuda): no plan slot " + std::to_string(slot));
  check_sparse_attention_cuda_params(p, impl_->limits);
  Impl::PlanSlot& s = impl_->plans[slot];
  s.built = true;
  s.tokens = p.num_tokens;
  s.heads = p.num_heads;
  s.swa_width = p.swa.width;
  s.extra_width = p.extra.width;
  s.cluster = impl_->cluster_for(p.num_heads);
  if (p.num_tokens == 0) return;
  cuda::AttnParams a = impl_->params(p, s);
  // The decode kernel reads every token's unit record, so its calls plan
  // the padded tokens too (as empty rows).
  a.real_tokens = decode_splits(p) > 0 ? nullptr : real_tokens;
  cuda::launch_plan(a, stream);
  cuda_check(cudaGetLastError(), "plan kernel launch");
}

void SparseAttentionCuda::run(const SparseAttentionParams& p, CUstream_st* stream, int slot, const OutputRope& out_rope,
                              ListsReady ready) {
  DSV4_REQUIRE(slot >= 0 && slot < int(impl_->plans.size()), "sparse attention (cuda): no plan slot " + std::to_string(slot));
  check_sparse_attention_cuda_params(p, impl_->limits);
  const Impl::PlanSlot& s = impl_->plans[slot];
  DSV4_REQUIRE(s.built, "sparse attention (cuda): run() before plan()");
  DSV4_REQUIRE(s.tokens == p.num_tokens && s.heads == p.num_heads && s.swa_width == p.swa.width &&
              s.extra_width == p.extra.width,
          "sparse attention (cuda): the plan was built for other tokens, heads or index widths");
  DSV4_REQUIRE(aligned(out_rope.cos_sin, 16), "sparse attention (cuda): the output rotation's table must be 16-byte aligned");
  if (p.num_tokens == 0) return;
  cuda::AttnParams a = impl_->params(p, s);
  a.rope_cs = reinterpret_cast<const float2*>(out_rope.cos_sin);
  a.swa_ready = ready.swa;
  a.extra_ready = ready.extra;
  a.records_ready = ready.records;
  if (const int splits = decode_splits(p); splits > 0) {
    cuda::launch_decode_attention(a, splits, decode_warps(p), stream);
    cuda_check(cudaGetLastError(), "decode attention kernel launch");
    return;
  }
  cuda::launch_attention(a, stream);
  cuda_check(cudaGetLastError(), "attention kernel launch");
  cuda::launch_combine(a, stream);
  cuda_check(cudaGetLastError(), "combine kernel launch");
}

}  // namespace dsv4
