#include "attn/sparse_attention.h"

#include <cmath>
#include <string>

#include "cache/fp8_ds_mla.h"
#include "common/error.h"

namespace dsv4 {
namespace {

void check_list(const KvPages& cache, const IndexList& list, const char* what) {
  const std::string w(what);
  DSV4_REQUIRE(list.width >= 0, w + ": negative index width");
  if (list.width == 0) return;
  DSV4_REQUIRE(list.indices && list.lengths, w + ": index list without indices or lengths");
  DSV4_REQUIRE(cache.base && cache.num_pages > 0, w + ": index list given but the cache has no pages");
  DSV4_REQUIRE(cache.entries_per_page > 0, w + ": entries_per_page must be positive");
}

}  // namespace

void check_sparse_attention_params(const SparseAttentionParams& p, bool need_q_out) {
  DSV4_REQUIRE(p.num_tokens >= 0, "sparse attention: negative token count");
  if (p.num_tokens == 0) return;
  DSV4_REQUIRE(p.num_heads > 0, "sparse attention: num_heads must be positive");
  DSV4_REQUIRE(!need_q_out || (p.q && p.out), "sparse attention: q and out are required");
  DSV4_REQUIRE(p.attn_sink != nullptr, "sparse attention: attn_sink is required");
  DSV4_REQUIRE(p.softmax_scale > 0 && std::isfinite(p.softmax_scale), "sparse attention: bad softmax scale");
  check_list(p.swa_cache, p.swa, "sparse attention (swa)");
  check_list(p.extra_cache, p.extra, "sparse attention (extra)");
}

}  // namespace dsv4
