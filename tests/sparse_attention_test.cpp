// The CPU backend of the sparse-attention interface against the float64
// reference shared with the GPU tests (tests/support/attention_reference.h).
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "attn/cpu/sparse_attention_cpu.h"
#include "cache/fp8_ds_mla.h"
#include "numerics/bf16.h"
#include "support/attention_reference.h"

using namespace dsv4;

namespace {

struct Problem {
  int tokens, heads, swa_width, extra_width, extra_page;
  std::vector<uint16_t> q, out;
  std::vector<float> sink, lse;
  std::vector<uint8_t> swa_pages, extra_pages;
  std::vector<int32_t> swa_idx, swa_len, extra_idx, extra_len;
  int64_t swa_num_pages = 8, extra_num_pages = 0;

  SparseAttentionParams params() {
    SparseAttentionParams p;
    p.num_tokens = tokens, p.num_heads = heads, p.q = q.data();
    p.swa_cache = KvPages{swa_pages.data(), swa_num_pages, 64, fp8_ds_mla_page_stride(64)};
    p.swa = IndexList{swa_idx.data(), swa_len.data(), swa_width};
    if (extra_width) {
      p.extra_cache = KvPages{extra_pages.data(), extra_num_pages, extra_page, fp8_ds_mla_page_stride(extra_page)};
      p.extra = IndexList{extra_idx.data(), extra_len.data(), extra_width};
    }
    p.attn_sink = sink.data(), p.softmax_scale = 1.0f / std::sqrt(512.0f);
    p.out = out.data(), p.lse = lse.data();
    return p;
  }
};

// Pages full of 0xFF (NaN codes and NaN scales) except the entries the lists
// reference, -1 holes, out-of-range slots, ragged and empty rows.
Problem make_problem(int tokens, int heads, int extra_width, int extra_page, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0, 1);
  Problem p{tokens, heads, 128, extra_width, extra_page, {}, {}, {}, {}, {}, {}, {}, {}, {}, {}};
  p.q.resize(size_t(tokens) * heads * 512);
  for (auto& v : p.q) v = bf16_bits(nd(rng) * 2.0f);
  p.sink.resize(size_t(heads));
  for (auto& v : p.sink) v = nd(rng);
  p.out.resize(p.q.size()), p.lse.resize(size_t(tokens) * heads);
  p.extra_num_pages = extra_width ? (extra_width + extra_page - 1) / extra_page + 2 : 0;
  p.swa_pages.assign(fp8_ds_mla_page_stride(64) * size_t(p.swa_num_pages), 0xFF);
  p.extra_pages.assign(fp8_ds_mla_page_stride(extra_page) * size_t(p.extra_num_pages), 0xFF);
  auto fill = [&](std::vector<uint8_t>& pages, int per_page, int64_t slot) {
    std::vector<float> kv(512);
    for (auto& v : kv) v = nd(rng);
    fp8_ds_mla_encode(kv.data(), pages.data() + size_t(slot / per_page) * fp8_ds_mla_page_stride(per_page), per_page,
                      int(slot % per_page));
  };
  auto lists = [&](int width, int64_t capacity, int per_page, std::vector<uint8_t>& pages, std::vector<int32_t>& idx,
                   std::vector<int32_t>& len) {
    idx.assign(size_t(tokens) * width, -1);
    len.assign(size_t(tokens), 0);
    for (int t = 0; t < tokens; ++t) {
      len[size_t(t)] = t == 0 ? 0 : int(rng() % (width + 1));
      for (int i = 0; i < len[size_t(t)]; ++i) {
        const uint32_t kind = rng() % 20;
        int32_t slot = int32_t(rng() % capacity);
        if (kind == 0) slot = -1;                                          // hole
        else if (kind == 1) slot = int32_t(capacity + rng() % 1000);      // out of range
        else if (kind == 2) slot = std::numeric_limits<int32_t>::max();   // far out of range
        else fill(pages, per_page, slot);
        idx[size_t(t) * width + i] = slot;
      }
    }
  };
  lists(128, p.swa_num_pages * 64, 64, p.swa_pages, p.swa_idx, p.swa_len);
  if (extra_width) lists(extra_width, p.extra_num_pages * extra_page, extra_page, p.extra_pages, p.extra_idx, p.extra_len);
  return p;
}

void check_against_reference(Problem& pr) {
  SparseAttentionParams p = pr.params();
  sparse_attention_cpu(p);
  std::vector<double> ref(size_t(p.num_heads) * 512), lse(size_t(p.num_heads));
  for (int t = 0; t < p.num_tokens; ++t) {
    test::reference_sparse_attention_token(p, t, test::ReferenceOptions{true}, ref.data(), lse.data());
    for (int h = 0; h < p.num_heads; ++h) {
      double num = 0, den = 0;
      for (int d = 0; d < 512; ++d) {
        const double got = bf16_to_float(pr.out[(size_t(t) * p.num_heads + h) * 512 + d]);
        ASSERT_TRUE(std::isfinite(got)) << "token " << t << " head " << h;  // a stray read would be NaN
        num += std::pow(got - ref[size_t(h) * 512 + d], 2);
        den += std::pow(ref[size_t(h) * 512 + d], 2);
      }
      if (den == 0) EXPECT_EQ(num, 0) << "token " << t;
      else EXPECT_LE(std::sqrt(num / den), 1e-2) << "token " << t << " head " << h;
      const float got_lse = pr.lse[size_t(t) * p.num_heads + h];
      if (std::isinf(lse[size_t(h)])) EXPECT_EQ(got_lse, -std::numeric_limits<float>::infinity());
      else EXPECT_NEAR(got_lse, lse[size_t(h)], 1e-5);
    }
  }
}

}  // namespace

TEST(SparseAttentionCpu, WindowOnly) {
  Problem p = make_problem(6, 64, 0, 64, 1);
  check_against_reference(p);
}

TEST(SparseAttentionCpu, WindowPlusTopKPages) {
  Problem p = make_problem(5, 128, 512, 64, 2);
  check_against_reference(p);
}

TEST(SparseAttentionCpu, WindowPlusC128APages) {
  Problem p = make_problem(4, 4, 1024, 2, 3);
  check_against_reference(p);
}

// ~100K (token, entry) pairs over ~1K distinct entries: the call decodes each
// distinct entry once, compacting its slot list several times on the way
// (past 2^16 pending slots); every token must still attend its own list.
TEST(SparseAttentionCpu, ManyTokensSharingEntries) {
  Problem p = make_problem(200, 4, 1024, 2, 5);
  check_against_reference(p);
}

TEST(SparseAttentionCpu, BadParamsAreErrors) {
  Problem p = make_problem(2, 4, 0, 64, 4);
  SparseAttentionParams params = p.params();
  params.softmax_scale = 0;
  EXPECT_THROW(sparse_attention_cpu(params), std::runtime_error);
  params = p.params();
  params.swa.lengths = nullptr;
  EXPECT_THROW(sparse_attention_cpu(params), std::runtime_error);
}
