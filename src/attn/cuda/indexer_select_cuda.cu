// Host side of the CUDA indexer selection: checks, workspace and launches.
#include "attn/cuda/indexer_select_cuda.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <mutex>
#include <string>
#include <vector>

#include "attn/cuda/device_info.h"
#include "attn/cuda/indexer_select_internal.cuh"
#include "common/error.h"

namespace dsv4 {
namespace {

void cuda_check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw Error(std::string("indexer select (cuda): ") + what + ": " + cudaGetErrorString(e));
}

bool aligned(const void* p, size_t a) { return reinterpret_cast<uintptr_t>(p) % a == 0; }

// Units per call: about one per multiprocessor. Every unit ends with a list
// of k keys (a block-wide radix select and, with bounds, a sort) that the
// finalize kernel merges again; at four per multiprocessor those lists took
// about a quarter of the score kernel at 128 tokens x 64K (Nsight Compute,
// docs/perf-notes.md run P3). Uneven units still even out: a persistent CTA
// takes the next unit from a counter.
constexpr int kUnitsPerSm = 1;

// run_short's bounds: 16 tokens, 4,096 keys (position 16,383), a token at least.
static_assert(indexer_short_select_fits(16, 16383) && !indexer_short_select_fits(17, 0) &&
              !indexer_short_select_fits(1, 16387) && !indexer_short_select_fits(0, 0));

}  // namespace

void check_indexer_select_cuda_params(const IndexerSelectParams& p, const IndexerSelectCudaLimits& limits) {
  check_indexer_select_params(p);
  DSV4_REQUIRE(p.num_tokens <= limits.max_tokens, "indexer select (cuda): " + std::to_string(p.num_tokens) +
                                                 " tokens exceed the limit of " + std::to_string(limits.max_tokens));
  if (p.num_tokens == 0) return;
  DSV4_REQUIRE(p.topk <= limits.topk, "indexer select (cuda): topk " + std::to_string(p.topk) + " exceeds the limit of " +
                                     std::to_string(limits.topk));
  DSV4_REQUIRE(p.queries.num_heads == cuda::ix::kHeads, "indexer select (cuda): the scorer needs 64 query heads");
  DSV4_REQUIRE(aligned(p.queries.codes, 16) && aligned(p.queries.scales, 4) && aligned(p.queries.weights, 4),
          "indexer select (cuda): query codes must be 16-byte, scales and weights 4-byte aligned");
  DSV4_REQUIRE(aligned(p.positions, 8) && aligned(p.token_run, 4) && aligned(p.real_tokens, 4),
          "indexer select (cuda): positions must be 8-byte, token_run and real_tokens 4-byte aligned");
  DSV4_REQUIRE(aligned(p.c4a_table.pages, 4) && aligned(p.c4a_table.first, 4), "indexer select (cuda): misaligned block table");
  DSV4_REQUIRE(aligned(p.picks, 4) && aligned(p.slots, 4) && aligned(p.lengths, 4), "indexer select (cuda): misaligned outputs");
  // 16-byte cp.async of the pages' planes.
  DSV4_REQUIRE(p.keys.num_pages == 0 || (aligned(p.keys.base, 16) && p.keys.page_stride % 16 == 0),
          "indexer select (cuda): key pages must be 16-byte aligned with a stride a multiple of 16");
}

struct IndexerSelectCuda::Impl {
  IndexerSelectCudaLimits limits;
  int grid = 0;
  bool solo = false;  // the last plan's grouping: IndexerGrouping::kOneTokenPerRun
  cuda::ix::Workspace ws;
  std::vector<void*> allocations;
  size_t bytes = 0;

  template <typename T>
  T* alloc(size_t count) {
    void* p = nullptr;
    cuda_check(cudaMalloc(&p, std::max<size_t>(1, count) * sizeof(T)), "cudaMalloc");
    allocations.push_back(p);
    bytes += count * sizeof(T);
    return static_cast<T*>(p);
  }
  ~Impl() {
    for (void* p : allocations) cudaFree(p);
  }

  cuda::ix::SelectArgs args(const IndexerSelectParams& p) const { return cuda::ix::SelectArgs{p, ws, solo}; }
};

IndexerSelectCuda::IndexerSelectCuda(const IndexerSelectCudaLimits& limits) : impl_(new Impl) {
  try {
    DSV4_REQUIRE(limits.max_tokens >= 0, "indexer select (cuda): negative max_tokens");
    DSV4_REQUIRE(limits.work_units >= 0, "indexer select (cuda): negative work_units");
    DSV4_REQUIRE(limits.topk >= 1 && limits.topk <= kIndexerMaxTopk, "indexer select (cuda): limits.topk must be in [1, 1024]");
    impl_->limits = limits;
    impl_->grid = cuda::device_sm_count();
    static std::once_flag once;
    std::call_once(once, [] {
      cuda::ix::prepare_score_kernels();
      cuda::ix::prepare_short_kernels();
    });
    cuda_check(cudaGetLastError(), "kernel attributes");
    cuda::ix::Workspace& ws = impl_->ws;
    const int tokens = std::max(1, limits.max_tokens);
    ws.target_units = limits.work_units > 0 ? limits.work_units : kUnitsPerSm * impl_->grid;
    // Finalize merges a token's S lists on one multiprocessor. It reads them
    // once and keeps only the keys at or above their bound (see
    // indexer_select_internal.cuh), so S = 128 lets a single token at 1M
    // context (4,096 tiles) score on 128 CTAs: 1M step 6.86 -> 6.30 ms
    // against S = 64 (docs/perf-notes.md, run E2).
    ws.max_group_units = cuda::ix::kMaxGroupUnits;
    ws.max_units = ws.target_units + tokens;
    ws.max_lists = cuda::ix::kGroupTokens * ws.target_units + tokens;
    ws.list_stride = limits.topk;
    ws.groups = impl_->alloc<cuda::ix::Group>(size_t(tokens));
    ws.tokens = impl_->alloc<cuda::ix::TokenRef>(size_t(tokens));
    ws.units = impl_->alloc<cuda::ix::Unit>(size_t(ws.max_units));
    ws.counters = impl_->alloc<cuda::ix::Counters>(1);
    ws.list_keys = impl_->alloc<uint64_t>(size_t(ws.max_lists) * size_t(ws.list_stride));
    ws.list_counts = impl_->alloc<int32_t>(size_t(ws.max_lists));
    ws.list_bounds = impl_->alloc<uint64_t>(size_t(ws.max_lists));
  } catch (...) {
    delete impl_;
    throw;
  }
}

IndexerSelectCuda::~IndexerSelectCuda() { delete impl_; }

void IndexerSelectCuda::plan(const IndexerSelectParams& p, CUstream_st* stream, IndexerGrouping grouping) {
  check_indexer_select_cuda_params(p, impl_->limits);
  impl_->solo = grouping == IndexerGrouping::kOneTokenPerRun;
  if (p.num_tokens == 0) return;
  cuda::ix::launch_plan(impl_->args(p), stream);
  cuda_check(cudaGetLastError(), "plan kernel");
}

void IndexerSelectCuda::score(const IndexerSelectParams& p, CUstream_st* stream, bool score_only) {
  check_indexer_select_cuda_params(p, impl_->limits);
  if (p.num_tokens == 0) return;
  cuda::ix::launch_score(impl_->args(p), impl_->grid, score_only, stream);
  cuda_check(cudaGetLastError(), "score kernel");
}

void IndexerSelectCuda::finalize(const IndexerSelectParams& p, CUstream_st* stream) {
  check_indexer_select_cuda_params(p, impl_->limits);
  if (p.num_tokens == 0) return;
  cuda::ix::launch_finalize(impl_->args(p), stream);
  cuda_check(cudaGetLastError(), "finalize kernel");
}

void IndexerSelectCuda::run(const IndexerSelectParams& p, CUstream_st* stream, IndexerGrouping grouping) {
  check_indexer_select_cuda_params(p, impl_->limits);
  impl_->solo = grouping == IndexerGrouping::kOneTokenPerRun;
  if (p.num_tokens == 0) return;
  const cuda::ix::SelectArgs a = impl_->args(p);
  cuda::ix::launch_plan(a, stream);
  cuda::ix::launch_score(a, impl_->grid, false, stream);
  cuda::ix::launch_finalize(a, stream);
  cuda_check(cudaGetLastError(), "kernels");
}

void IndexerSelectCuda::run_planned(const IndexerSelectParams& p, CUstream_st* stream) {
  check_indexer_select_cuda_params(p, impl_->limits);
  if (p.num_tokens == 0) return;
  const cuda::ix::SelectArgs a = impl_->args(p);
  cuda::ix::launch_score(a, impl_->grid, false, stream);
  cuda::ix::launch_finalize(a, stream);
  cuda_check(cudaGetLastError(), "kernels");
}

void IndexerSelectCuda::run_short(const IndexerSelectParams& p, CUstream_st* stream) {
  check_indexer_select_cuda_params(p, impl_->limits);
  DSV4_REQUIRE(p.num_tokens <= kShortSelectMaxTokens, "indexer select (cuda): run_short takes at most " +
                                                          std::to_string(kShortSelectMaxTokens) + " tokens, not " +
                                                          std::to_string(p.num_tokens));
  if (p.num_tokens == 0) return;
  cuda::ix::launch_short(p, stream);
  cuda_check(cudaGetLastError(), "short kernel");
}

const IndexerSelectCudaLimits& IndexerSelectCuda::limits() const { return impl_->limits; }
int IndexerSelectCuda::grid_size() const { return impl_->grid; }
size_t IndexerSelectCuda::workspace_bytes() const { return impl_->bytes; }

}  // namespace dsv4
