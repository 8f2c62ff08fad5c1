// The CPU backend of the sparse-attention interface: decode the attended
// entries of each token, then attend_heads, in production or exact numerics.
#include "attn/cpu/sparse_attention_cpu.h"

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "attn/cpu/attend.h"
#include "cache/fp8_ds_mla.h"
#include "common/error.h"
#include "numerics/bf16.h"

namespace dsv4 {
namespace {

// How a 512-dim entry is stored.
enum class KvFormat { kFp8DsMla, kF32 };

void check_stride(const KvPages& cache, const IndexList& list, KvFormat f, const char* what) {
  if (list.width == 0) return;
  const size_t need = f == KvFormat::kF32 ? f32_kv_page_stride(cache.entries_per_page)
                                          : fp8_ds_mla_page_stride(cache.entries_per_page);
  DSV4_REQUIRE(cache.page_stride >= need, std::string(what) + ": page stride smaller than a page of its entries");
}

// One entry of the cache as 512 floats.
void decode_entry(const KvPages& cache, KvFormat f, int64_t slot, float* dst) {
  const uint8_t* page = cache.page(slot / cache.entries_per_page);
  const int e = int(slot % cache.entries_per_page);
  if (f == KvFormat::kF32) std::memcpy(dst, page + f32_kv_page_stride(1) * size_t(e), f32_kv_page_stride(1));
  else fp8_ds_mla_decode(page, cache.entries_per_page, e, dst);
}

// The distinct entries one list of a call attends, each decoded once: the
// tokens of a chunk share most of their window and many compressed entries,
// so decoding per (token, entry) would repeat the same work up to the list
// width times. A slot < 0 or past the cache's capacity is an empty position:
// nothing is read for it.
class DecodedEntries {
 public:
  DecodedEntries(const KvPages& cache, const IndexList& list, int num_tokens, KvFormat f) {
    if (list.width == 0) return;
    // Sorted and made distinct whenever the list grows past twice what it
    // held after the last pass, so it never holds much more than the
    // distinct entries (not tokens x width).
    size_t distinct = 0;
    const auto make_distinct = [&] {
      std::sort(slots_.begin(), slots_.end());
      slots_.erase(std::unique(slots_.begin(), slots_.end()), slots_.end());
      distinct = slots_.size();
    };
    for (int t = 0; t < num_tokens; ++t) {
      const int32_t* idx = list.indices + size_t(t) * list.width;
      for (int i = 0, len = std::clamp(list.lengths[t], 0, list.width); i < len; ++i)
        if (idx[i] >= 0 && idx[i] < cache.capacity()) slots_.push_back(idx[i]);
      if (slots_.size() > 2 * distinct + (size_t(1) << 16)) make_distinct();
    }
    make_distinct();
    values_.resize(slots_.size() * kKvDim);
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < int64_t(slots_.size()); ++i) decode_entry(cache, f, slots_[size_t(i)], values_.data() + i * kKvDim);
  }

  // Appends token t's entries of `list`, in list order, to keys.
  void gather(const IndexList& list, int t, std::vector<float>& keys) const {
    if (list.width == 0) return;
    const int32_t* idx = list.indices + size_t(t) * list.width;
    for (int i = 0, len = std::clamp(list.lengths[t], 0, list.width); i < len; ++i) {
      const auto it = std::lower_bound(slots_.begin(), slots_.end(), int64_t(idx[i]));
      if (it == slots_.end() || *it != idx[i]) continue;  // an empty position
      const float* v = values_.data() + size_t(it - slots_.begin()) * kKvDim;
      keys.insert(keys.end(), v, v + kKvDim);
    }
  }

 private:
  std::vector<int64_t> slots_;  // sorted, distinct, inside the cache
  std::vector<float> values_;   // [slots_.size(), kKvDim]
};

// Every token: gather its entries, attend all heads. load_q(t, q) fills the
// token's [H, 512] query, store(t, out) takes its output.
template <typename LoadQ, typename Store>
void attend_tokens(const SparseAttentionParams& p, KvFormat f, bool production, LoadQ load_q, Store store) {
  const int H = p.num_heads;
  const AttendOptions opt{p.softmax_scale, production};
  const DecodedEntries swa(p.swa_cache, p.swa, p.num_tokens, f), extra(p.extra_cache, p.extra, p.num_tokens, f);
#pragma omp parallel
  {
    std::vector<float> keys, q(size_t(H) * kKvDim), out(size_t(H) * kKvDim), scratch;
#pragma omp for schedule(dynamic)
    for (int t = 0; t < p.num_tokens; ++t) {
      keys.clear();
      swa.gather(p.swa, t, keys);
      extra.gather(p.extra, t, keys);
      const int n = int(keys.size() / kKvDim);
      scratch.resize(size_t(H) * size_t(std::max(n, 1)));
      load_q(t, q.data());
      attend_heads(q.data(), H, keys.data(), n, p.attn_sink, opt, out.data(), p.lse ? p.lse + size_t(t) * H : nullptr,
                   scratch.data());
      store(t, out.data());
    }
  }
}

}  // namespace

void sparse_attention_cpu(const SparseAttentionParams& p) {
  check_sparse_attention_params(p);
  check_stride(p.swa_cache, p.swa, KvFormat::kFp8DsMla, "sparse attention (swa)");
  check_stride(p.extra_cache, p.extra, KvFormat::kFp8DsMla, "sparse attention (extra)");
  const size_t row = size_t(p.num_heads) * kKvDim;
  attend_tokens(
      p, KvFormat::kFp8DsMla, true,
      [&](int t, float* q) {
        for (size_t i = 0; i < row; ++i) q[i] = bf16_to_float(p.q[size_t(t) * row + i]);
      },
      [&](int t, const float* out) {
        for (size_t i = 0; i < row; ++i) p.out[size_t(t) * row + i] = bf16_bits(out[i]);
      });
}

void sparse_attention_exact_cpu(const SparseAttentionParams& p, const float* q, float* out) {
  check_sparse_attention_params(p, false);
  DSV4_REQUIRE(p.num_tokens == 0 || (q && out), "sparse attention (exact): q and out are required");
  check_stride(p.swa_cache, p.swa, KvFormat::kF32, "sparse attention (swa)");
  check_stride(p.extra_cache, p.extra, KvFormat::kF32, "sparse attention (extra)");
  const size_t row = size_t(p.num_heads) * kKvDim;
  attend_tokens(
      p, KvFormat::kF32, false, [&](int t, float* qt) { std::memcpy(qt, q + size_t(t) * row, row * sizeof(float)); },
      [&](int t, const float* o) { std::memcpy(out + size_t(t) * row, o, row * sizeof(float)); });
}

}  // namespace dsv4
