// The CPU backend of the sparse-attention interface: decode the attended
// fp8_ds_mla entries of each token, then attend_heads with production numerics.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "attn/cpu/attend.h"
#include "attn/sparse_attention.h"
#include "cache/fp8_ds_mla.h"
#include "common/error.h"
#include "numerics/bf16.h"

namespace dsv4 {
namespace {

void check_list(const KvPages& cache, const IndexList& list, const char* what) {
  if (list.width == 0) return;
  const std::string w(what);
  require(list.width > 0, w + ": negative index width");
  require(list.indices && list.lengths, w + ": index list without indices or lengths");
  require(cache.base && cache.num_pages > 0, w + ": index list given but the cache has no pages");
  require(cache.entries_per_page > 0, w + ": entries_per_page must be positive");
  require(cache.page_stride >= fp8_ds_mla_page_stride(cache.entries_per_page),
          w + ": page stride smaller than an fp8_ds_mla page");
}

// Appends the decoded entries of one token's list to `keys`.
void gather(const KvPages& cache, const IndexList& list, int t, std::vector<float>& keys) {
  if (list.width == 0) return;
  const int len = std::clamp(list.lengths[t], 0, list.width);
  const int32_t* idx = list.indices + size_t(t) * list.width;
  for (int i = 0; i < len; ++i) {
    const int64_t slot = idx[i];
    if (slot < 0 || slot >= cache.capacity()) continue;  // empty position
    const uint8_t* page = cache.base + size_t(slot / cache.entries_per_page) * cache.page_stride;
    keys.resize(keys.size() + kKvDim);
    fp8_ds_mla_decode(page, cache.entries_per_page, int(slot % cache.entries_per_page),
                      keys.data() + keys.size() - kKvDim);
  }
}

}  // namespace

void check_sparse_attention_params(const SparseAttentionParams& p) {
  require(p.num_tokens >= 0, "sparse attention: negative token count");
  if (p.num_tokens == 0) return;
  require(p.num_heads > 0, "sparse attention: num_heads must be positive");
  require(p.q && p.out && p.attn_sink, "sparse attention: q, out and attn_sink are required");
  require(p.softmax_scale > 0 && std::isfinite(p.softmax_scale), "sparse attention: bad softmax scale");
  check_list(p.swa_cache, p.swa, "sparse attention (swa)");
  check_list(p.extra_cache, p.extra, "sparse attention (extra)");
}

void sparse_attention_cpu(const SparseAttentionParams& p) {
  check_sparse_attention_params(p);
  const int H = p.num_heads;
  const AttendOptions opt{p.softmax_scale, true};
#pragma omp parallel
  {
    std::vector<float> keys, q(size_t(H) * kKvDim), out(size_t(H) * kKvDim), scratch;
#pragma omp for schedule(dynamic)
    for (int t = 0; t < p.num_tokens; ++t) {
      keys.clear();
      gather(p.swa_cache, p.swa, t, keys);
      gather(p.extra_cache, p.extra, t, keys);
      const int n = int(keys.size() / kKvDim);
      scratch.resize(size_t(H) * std::max(n, 1));
      const uint16_t* qt = p.q + size_t(t) * H * kKvDim;
      for (size_t i = 0; i < q.size(); ++i) q[i] = bf16_to_float(qt[i]);
      attend_heads(q.data(), H, keys.data(), n, p.attn_sink, opt, out.data(), p.lse ? p.lse + size_t(t) * H : nullptr,
                   scratch.data());
      uint16_t* ot = p.out + size_t(t) * H * kKvDim;
      for (size_t i = 0; i < out.size(); ++i) ot[i] = bf16_bits(out[i]);
    }
  }
}

}  // namespace dsv4
