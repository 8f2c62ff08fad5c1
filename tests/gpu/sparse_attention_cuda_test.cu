// GPU sparse attention (attn/cuda) against the float64 reference on random
// problems. Every test skips itself where no CUDA device is present.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "attn/cuda/fp8_dequant.cuh"
#include "attn/cuda/out_rope.h"
#include "attn/cuda/pdl.cuh"
#include "attn/cuda/ptx.cuh"
#include "attn/cuda/sparse_attention_cuda.h"
#include "attn/cuda/sparse_mla_internal.cuh"
#include "common/error.h"
#include "numerics/e4m3.h"
#include "numerics/rope.h"
#include "numerics/ue8m0.h"
#include "sparse_attention_case.h"

namespace dsv4::test {
namespace {

// Every test skips itself where no CUDA device is present.
class SparseAttentionCudaTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!have_cuda_device()) GTEST_SKIP() << "no CUDA device";
  }
};

// The kernel run() takes for a call: the decode kernel (sparse_mla_decode.cu)
// or the tile kernel with its combine.
// The decode kernel in CTAs of 4 (chunks of 32 entries), 8 (64) or 16 warps (128).
enum class Path { kDecode, kDecode8, kDecode16, kTiles };
bool is_decode(Path k) { return k != Path::kTiles; }
int decode_warps(Path k) { return k == Path::kDecode16 ? 16 : k == Path::kDecode8 ? 8 : 4; }
const char* path_name(Path k) {
  return k == Path::kTiles ? "tile kernel" : k == Path::kDecode ? "decode kernel (4 warps)"
         : k == Path::kDecode8 ? "decode kernel (8 warps)" : "decode kernel (16 warps)";
}

// Limits that send a call of `tokens` tokens down `path` where its rows allow.
SparseAttentionCudaLimits limits_for(int tokens, Path path, bool single_ctas = false) {
  SparseAttentionCudaLimits l{tokens, 128, 1, single_ctas};
  l.decode_max_tokens = is_decode(path) ? tokens : 0;
  l.decode_max_entries = cuda::kDecodeMaxEntries;  // splits of several chunks too
  l.decode_max_work = int64_t(tokens) * cuda::kDecodeMaxEntries;
  l.decode_warps = decode_warps(path);
  return l;
}

// Plans, runs (outputs poisoned first) and compares with the reference.
// lse_rel adds a bound relative to |lse| (see LargeLogits). Calls the decode
// kernel takes (few tokens, short rows) run on both kernels.
void run_and_check(const CaseSpec& spec, int max_tokens = 0, double lse_rel = 0.0, bool single_ctas = false) {
  const HostCase hc = make_case(spec);
  DeviceCase dc(hc);
  const Reference ref = reference(hc.params());
  for (const Path path : {Path::kDecode, Path::kDecode8, Path::kDecode16, Path::kTiles}) {
    SparseAttentionCuda attn(limits_for(max_tokens > 0 ? max_tokens : spec.tokens, path, single_ctas));
    const bool decode = attn.decode_splits(dc.p) > 0;
    if (is_decode(path) && !decode) continue;  // rows too long or too many tokens: the tile kernel only
    EXPECT_EQ(decode, is_decode(path));
    std::vector<uint16_t> out;
    std::vector<float> lse;
    dc.plan_run_download(attn, out, lse);
    CompareStats st = compare(ref, out, lse, spec.tokens, spec.heads);
    if (lse_rel > 0) {  // re-check lse with the relative allowance
      st.bad_lse = 0;
      for (size_t i = 0; i < lse.size(); ++i) {
        const double r = ref.lse[i], g = lse[i];
        const bool ok = std::isinf(r) ? (std::isinf(g) && g < 0) : std::fabs(g - r) <= 1e-5 + lse_rel * std::fabs(r);
        st.bad_lse += !ok;
      }
    }
    EXPECT_EQ(st.bad_rows, 0) << path_name(path) << ": " << st.first_failure << " (nan rows " << st.nan_rows << ")";
    EXPECT_EQ(st.bad_lse, 0) << path_name(path) << ": " << st.first_failure;
    ::testing::Test::RecordProperty("max_rel_l2", std::to_string(st.max_rel));
    ::testing::Test::RecordProperty("max_lse_diff", std::to_string(st.max_lse_diff));
    std::printf("    %s: rows %d  max rel L2 %.3e  max |lse diff| %.3e  max |lse| %.1f\n", path_name(path), st.rows,
                st.max_rel, st.max_lse_diff, st.max_abs_lse);
  }
}

// ---- the dequantization itself: bit-exact against the CPU codec -------------

__global__ void dequant_kernel(const uint32_t* words, const uint8_t* scales, uint32_t* out, int chunks) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= chunks) return;
  const uint32_t w[4] = {words[4 * i], words[4 * i + 1], words[4 * i + 2], words[4 * i + 3]};
  const dsv4::cuda::ScaleFactors f = dsv4::cuda::scale_factors(scales[i]);
  uint32_t o[8];
  if (scales[i] > 134)
    dsv4::cuda::dequant_chunk<true>(w, f, o);
  else
    dsv4::cuda::dequant_chunk<false>(w, f, o);
  for (int k = 0; k < 8; ++k) out[8 * i + k] = o[k];
}

TEST_F(SparseAttentionCudaTest, DequantIsExactForAllCodesAndScales) {
  // Every non-NaN e4m3 code (subnormals included) under every scale byte from
  // 64 up (smaller scales would need bf16 subnormal results; no real cache
  // has them) and the NaN scale byte 255.
  std::vector<uint8_t> codes;
  for (int c = 0; c < 256; ++c)
    if ((c & 0x7f) != 0x7f) codes.push_back(uint8_t(c));
  while (codes.size() % 16) codes.push_back(0);
  const int per_scale = int(codes.size() / 16);
  std::vector<uint32_t> words;
  std::vector<uint8_t> scales;
  for (int sb = 64; sb < 256; ++sb)
    for (int k = 0; k < per_scale; ++k) {
      uint32_t w[4];
      std::memcpy(w, codes.data() + 16 * k, 16);
      words.insert(words.end(), w, w + 4);
      scales.push_back(uint8_t(sb));
    }
  const int chunks = int(scales.size());
  uint32_t *dw, *dout;
  uint8_t* ds;
  DSV4_CUDA_OK(cudaMalloc(&dw, words.size() * 4));
  DSV4_CUDA_OK(cudaMalloc(&ds, scales.size()));
  DSV4_CUDA_OK(cudaMalloc(&dout, size_t(chunks) * 32));
  cudaMemcpy(dw, words.data(), words.size() * 4, cudaMemcpyHostToDevice);
  cudaMemcpy(ds, scales.data(), scales.size(), cudaMemcpyHostToDevice);
  dequant_kernel<<<(chunks + 127) / 128, 128>>>(dw, ds, dout, chunks);
  DSV4_CUDA_OK(cudaDeviceSynchronize());
  std::vector<uint32_t> out(size_t(chunks) * 8);
  cudaMemcpy(out.data(), dout, out.size() * 4, cudaMemcpyDeviceToHost);
  cudaFree(dw);
  cudaFree(ds);
  cudaFree(dout);
  int bad = 0;
  for (int i = 0; i < chunks; ++i) {
    const uint8_t* bytes = reinterpret_cast<const uint8_t*>(&words[4 * size_t(i)]);
    for (int d = 0; d < 16; ++d) {
      const uint16_t got = uint16_t(out[8 * size_t(i) + d / 2] >> (16 * (d % 2)));
      const float want = e4m3_to_float(bytes[d]) * ue8m0_to_float(scales[i]);
      const bool ok = std::isnan(want) ? std::isnan(bf16_to_float(got)) : got == bf16_bits(want);
      if (!ok && bad++ < 5)
        ADD_FAILURE() << "code " << int(bytes[d]) << " scale byte " << int(scales[i]) << ": got 0x" << std::hex << got
                      << " want 0x" << bf16_bits(want);
    }
  }
  EXPECT_EQ(bad, 0);
}

// ---- accuracy over the shapes of SPEC §8 --------------------------------------

TEST_F(SparseAttentionCudaTest, WindowOnlyH64) { run_and_check({.tokens = 37, .heads = 64, .seed = 11}); }

TEST_F(SparseAttentionCudaTest, WindowOnlyH128FullLengths) {
  run_and_check({.tokens = 9, .heads = 128, .ragged = false, .hole_rate = 0, .oor_rate = 0, .seed = 12});
}

TEST_F(SparseAttentionCudaTest, Extra512Page64H64) {
  run_and_check({.tokens = 29, .heads = 64, .extra_width = 512, .extra_page = 64, .seed = 13});
}

TEST_F(SparseAttentionCudaTest, Extra1024Page64H128) {
  run_and_check({.tokens = 13, .heads = 128, .extra_width = 1024, .extra_page = 64, .seed = 14});
}

TEST_F(SparseAttentionCudaTest, Extra1024Page2H64) {
  run_and_check({.tokens = 21, .heads = 64, .extra_width = 1024, .extra_page = 2, .seed = 15});
}

// A page size that is not a power of two: the kernel divides instead of shifting.
TEST_F(SparseAttentionCudaTest, Extra512Page3H64) {
  run_and_check({.tokens = 17, .heads = 64, .extra_width = 512, .extra_page = 3, .seed = 23});
}

TEST_F(SparseAttentionCudaTest, Extra8192Page2H64) {
  run_and_check({.tokens = 4, .heads = 64, .extra_width = 8192, .extra_page = 2, .seed = 16});
}

TEST_F(SparseAttentionCudaTest, Extra8192Page2H128FullLengths) {
  run_and_check({.tokens = 2, .heads = 128, .extra_width = 8192, .extra_page = 2, .ragged = false, .seed = 17});
}

TEST_F(SparseAttentionCudaTest, LargeLogits) {
  // q gains up to 16 (logits ~80): outputs still within 1e-2; lse carries the
  // rounding of fp32 tensor-core accumulation of the top logits, ~3e-7 of |lse|.
  run_and_check({.tokens = 16, .heads = 64, .extra_width = 1024, .extra_page = 2, .seed = 26, .max_gain_log2 = 4}, 0, 1e-6);
}

TEST_F(SparseAttentionCudaTest, SmallHeadCountIsPadded) {
  run_and_check({.tokens = 50, .heads = 4, .extra_width = 512, .extra_page = 64, .seed = 18});
  run_and_check({.tokens = 7, .heads = 96, .extra_width = 1024, .extra_page = 2, .seed = 19});
  // Whole units (one tile each): the pair's second CTA writes only its 32
  // real heads (the guard behind the outputs catches more).
  run_and_check({.tokens = 7, .heads = 96, .seed = 32});
}

TEST_F(SparseAttentionCudaTest, EmptyRowsGiveZeroAndMinusInfinity) {
  // Rows of length 0 and rows made only of -1, among normal rows, split and not.
  run_and_check({.tokens = 24, .heads = 64, .extra_width = 512, .extra_page = 64, .empty_rows = 10, .seed = 20});
  run_and_check({.tokens = 6, .heads = 64, .extra_width = 1024, .extra_page = 2, .empty_rows = 6, .seed = 21});
}

TEST_F(SparseAttentionCudaTest, ManyTokensMixedSplits) {
  // More units than CTAs, ragged: whole units, split units and CTA ranges
  // that start and end inside units.
  run_and_check({.tokens = 300, .heads = 64, .extra_width = 1024, .extra_page = 64, .seed = 22});
}

// H = 128 runs on pairs of CTAs (clusters) that share each tile's
// dequantization; the same calls on one CTA per head block must agree with
// the reference too (that path serves other even head counts' fallbacks
// and keeps the walker's multi-block bookkeeping tested).
TEST_F(SparseAttentionCudaTest, ManyTokensMixedSplitsH128) {
  run_and_check({.tokens = 150, .heads = 128, .extra_width = 1024, .extra_page = 64, .seed = 27});
  run_and_check({.tokens = 40, .heads = 128, .extra_width = 1024, .extra_page = 2, .empty_rows = 5, .seed = 28});
}

TEST_F(SparseAttentionCudaTest, H128OnSingleCtas) {
  run_and_check({.tokens = 13, .heads = 128, .extra_width = 1024, .extra_page = 64, .seed = 14}, 0, 0.0, true);
  run_and_check({.tokens = 150, .heads = 128, .extra_width = 1024, .extra_page = 64, .seed = 27}, 0, 0.0, true);
  run_and_check({.tokens = 2, .heads = 128, .extra_width = 8192, .extra_page = 2, .ragged = false, .seed = 17}, 0, 0.0,
                true);
}

TEST_F(SparseAttentionCudaTest, PrefillChunk) {
  // A prefill-like call: many tokens, full windows and selections.
  run_and_check({.tokens = 512, .heads = 64, .extra_width = 512, .extra_page = 64, .ragged = false, .seed = 23});
}

TEST_F(SparseAttentionCudaTest, SanitizerSmall) {
  // Small enough for compute-sanitizer: a split unit, an empty row, padding.
  run_and_check({.tokens = 3, .heads = 4, .swa_width = 128, .extra_width = 256, .extra_page = 2, .empty_rows = 1, .seed = 24});
  run_and_check({.tokens = 2, .heads = 64, .extra_width = 2048, .extra_page = 64, .seed = 25});
  run_and_check({.tokens = 2, .heads = 128, .extra_width = 512, .extra_page = 2, .empty_rows = 1, .seed = 29});
}

// ---- the decode kernel ------------------------------------------------------

TEST_F(SparseAttentionCudaTest, DecodeKernelTakesFewTokensWithShortRows) {
  const HostCase hc = make_case({.tokens = 4, .heads = 64, .extra_width = 512, .seed = 80});
  DeviceCase dc(hc);
  // The defaults: rows of up to 1,024 entries and 2,048 over the call's
  // tokens; one or two tokens with rows past 256 entries on CTAs of 16 warps
  // (chunks of 128), the others on 8 (64).
  SparseAttentionCuda defaults({16, 128, 1});
  SparseAttentionParams p = dc.p;
  EXPECT_EQ(defaults.decode_splits(p), 0);  // 4 x 640 entries: the tile kernel
  p.num_tokens = 1;
  EXPECT_EQ(defaults.decode_warps(p), 16);
  EXPECT_EQ(defaults.decode_splits(p), 5);  // 640 entries: 5 chunks of 128
  p.extra.width = cuda::kDecodeMaxEntries - p.swa.width;
  EXPECT_EQ(defaults.decode_splits(p), 8);
  p.extra.width += 1;
  EXPECT_EQ(defaults.decode_splits(p), 0);  // rows too long
  p.extra.width = 0;  // the window alone: 8 warps, two splits of 64
  EXPECT_EQ(defaults.decode_warps(p), 8);
  EXPECT_EQ(defaults.decode_splits(p), 2);
  p = dc.p;
  p.extra.width = 128;  // 4 x 256 entries
  EXPECT_EQ(defaults.decode_warps(p), 8);
  EXPECT_EQ(defaults.decode_splits(p), 4);
  p.num_tokens = 8;  // 2,048 entries
  EXPECT_EQ(defaults.decode_splits(p), 4);
  p.extra.width = 129;
  EXPECT_EQ(defaults.decode_splits(p), 0);  // 2,056
  // Set limits: CTAs of 4 warps (chunks of 32), no bound over the tokens.
  SparseAttentionCudaLimits longer{16, 128, 1};
  longer.decode_max_work = int64_t(16) * cuda::kDecodeMaxEntries;
  longer.decode_warps = 4;
  SparseAttentionCuda attn(longer);
  p = dc.p;
  EXPECT_EQ(attn.decode_splits(p), 8);  // 640 entries: 8 splits of a cluster
  p.extra.width = 0;
  EXPECT_EQ(attn.decode_splits(p), 4);  // the window alone: a chunk of 32 a split
  p.swa.width = 0;
  EXPECT_EQ(attn.decode_splits(p), 1);  // nothing to attend: one split writes the zeros
  p = dc.p;
  p.extra.width = cuda::kDecodeMaxEntries - p.swa.width + 1;
  EXPECT_EQ(attn.decode_splits(p), 0);  // rows too long
  p = dc.p;
  p.num_tokens = 17;
  EXPECT_EQ(attn.decode_splits(p), 0);  // too many tokens
  SparseAttentionCuda tiles(limits_for(16, Path::kTiles));
  EXPECT_EQ(tiles.decode_splits(dc.p), 0);
  EXPECT_THROW(SparseAttentionCuda(SparseAttentionCudaLimits{4, 64, 1, false, -1}), Error);
  EXPECT_THROW(SparseAttentionCuda(SparseAttentionCudaLimits{4, 64, 1, false, 16, cuda::kDecodeMaxEntries + 1}), Error);
  EXPECT_THROW(SparseAttentionCuda(SparseAttentionCudaLimits{4, 64, 1, false, 16, 256, -1}), Error);
  // CTAs of 16 warps take chunks of 128 entries: fewer splits.
  longer.decode_warps = 16;
  SparseAttentionCuda wide(longer);
  EXPECT_EQ(wide.decode_warps(dc.p), 16);
  EXPECT_EQ(wide.decode_splits(dc.p), 5);  // 640 entries
  p = dc.p;
  p.extra.width = 0;
  EXPECT_EQ(wide.decode_splits(p), 1);  // the window alone: one CTA a group of heads
  longer.decode_warps = 8;
  EXPECT_EQ(SparseAttentionCuda(longer).decode_splits(dc.p), 8);  // 640 entries: 10 chunks of 64, 8 splits
  longer.decode_warps = 5;
  EXPECT_THROW(SparseAttentionCuda{longer}, Error);
}

TEST_F(SparseAttentionCudaTest, DecodeKernelShapes) {
  // One token (batch-1 decode: window only, and C4A's 640 entries), a few
  // tokens with pages of 2, 3 and 64, head counts that pad a group of 16
  // (4, 96) and H = 128; ragged rows shorter than the splits, holes and
  // out-of-range slots; empty rows.
  run_and_check({.tokens = 1, .heads = 64, .seed = 81});
  run_and_check({.tokens = 1, .heads = 64, .extra_width = 512, .extra_page = 64, .ragged = false, .seed = 82});
  run_and_check({.tokens = 4, .heads = 128, .extra_width = 512, .extra_page = 2, .empty_rows = 1, .seed = 83});
  run_and_check({.tokens = 16, .heads = 64, .extra_width = 896, .extra_page = 3, .seed = 84});
  run_and_check({.tokens = 8, .heads = 4, .extra_width = 64, .extra_page = 2, .empty_rows = 2, .seed = 85});
  run_and_check({.tokens = 3, .heads = 96, .swa_width = 20, .extra_width = 44, .extra_page = 64, .seed = 86});
  run_and_check({.tokens = 12, .heads = 64, .extra_width = 64, .extra_page = 64, .hole_rate = 0.5, .seed = 87});
}

// Lists marked ready are read before the kernel's wait: the same bits
// (rows of 640 entries: three chunks a split at 4 warps, two at 8).
TEST_F(SparseAttentionCudaTest, DecodeKernelListsReadyGiveTheSameBits) {
  for (const Path path : {Path::kDecode, Path::kDecode8, Path::kDecode16}) {
    SCOPED_TRACE(path_name(path));
    const HostCase hc = make_case({.tokens = 4, .heads = 64, .extra_width = 512, .extra_page = 2, .seed = 88});
    DeviceCase dc(hc);
    SparseAttentionCuda attn(limits_for(4, path));
    ASSERT_GT(attn.decode_splits(dc.p), 0);
    std::vector<uint16_t> plain, ready;
    std::vector<float> plain_lse, ready_lse;
    dc.plan_run_download(attn, plain, plain_lse);
    const Reference ref = reference(hc.params());
    // Lists alone, then the records before the wait too (both lists, the window's alone).
    for (const ListsReady r : {ListsReady{true, true}, ListsReady{true, true, true}, ListsReady{true, false, true}}) {
      SCOPED_TRACE(r.extra ? (r.records ? "lists and records" : "lists") : "window and records");
      dc.poison();
      attn.run(dc.p, nullptr, 0, {}, r);
      DSV4_CUDA_OK(cudaDeviceSynchronize());
      dc.download(ready, ready_lse);
      EXPECT_EQ(std::memcmp(plain.data(), ready.data(), plain.size() * 2), 0);
      EXPECT_EQ(std::memcmp(plain_lse.data(), ready_lse.data(), plain_lse.size() * 4), 0);
      const CompareStats st = compare(ref, ready, ready_lse, 4, 64);
      EXPECT_EQ(st.bad_rows + st.bad_lse, 0) << st.first_failure;
    }
  }
}

// Writes bytes[i] at dst[offsets[i]] `delay_ns` after it started, having let
// the next kernel (launched with PDL) start at once: a layer's own token's
// record, written while the attention's CTAs are already resident.
__global__ void late_writes_kernel(uint8_t* dst, const uint32_t* offsets, const uint8_t* bytes, int n,
                                   long long delay_ns) {
  cuda::launch_dependents();
  const uint64_t t0 = cuda::global_timer_ns();
  do __nanosleep(1000);
  while (cuda::global_timer_ns() - t0 < uint64_t(delay_ns));
  for (int i = int(threadIdx.x); i < n; i += int(blockDim.x)) dst[offsets[i]] = bytes[i];
}

// ListsReady::records: the records of each list's last num_tokens entries
// (the call's own tokens') are read only after the wait, all others before
// it. Here the last entry of each of a token's two lists gets a new record
// from a kernel that lets the attention start first and writes 50 us later:
// the output must be that of the new records, bit for bit (read before the
// wait, the old record would still be there).
TEST_F(SparseAttentionCudaTest, DecodeKernelReadsItsTokensRecordsAfterTheWait) {
  const CaseSpec spec{.tokens = 1, .heads = 64, .extra_width = 512, .extra_page = 64, .ragged = false,
                      .hole_rate = 0.0, .oor_rate = 0.0, .seed = 89};
  HostCase old_case = make_case(spec);
  HostCase new_case = old_case;
  std::mt19937_64 rng(90);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> kv(kKvDim);
  // The last entry of each list: a slot no other entry of the row uses, with
  // one record in the old case and another in the new.
  auto renew_tail = [&](Cache& old_cache, Cache& new_cache, std::vector<int32_t>& old_idx,
                        std::vector<int32_t>& new_idx, int width) {
    std::vector<char> taken(size_t(old_cache.capacity()), 0);
    for (int i = 0; i + 1 < width; ++i) taken[size_t(old_idx[size_t(i)])] = 1;
    int32_t slot = 0;
    while (taken[size_t(slot)]) ++slot;
    old_idx[size_t(width - 1)] = new_idx[size_t(width - 1)] = slot;
    for (Cache* c : {&old_cache, &new_cache}) {
      for (float& v : kv) v = nd(rng);
      uint8_t* page = c->bytes.data() + size_t(slot / c->entries_per_page) * c->stride();
      fp8_ds_mla_encode(kv.data(), page, c->entries_per_page, int(slot % c->entries_per_page));
    }
  };
  renew_tail(old_case.swa, new_case.swa, old_case.swa_idx, new_case.swa_idx, spec.swa_width);
  renew_tail(old_case.extra, new_case.extra, old_case.extra_idx, new_case.extra_idx, spec.extra_width);
  // The bytes that differ, as offsets into one buffer holding both caches' bytes.
  std::vector<uint8_t> both = old_case.swa.bytes, fresh = new_case.swa.bytes;
  both.insert(both.end(), old_case.extra.bytes.begin(), old_case.extra.bytes.end());
  fresh.insert(fresh.end(), new_case.extra.bytes.begin(), new_case.extra.bytes.end());
  std::vector<uint32_t> offsets;
  std::vector<uint8_t> bytes;
  for (size_t i = 0; i < both.size(); ++i)
    if (both[i] != fresh[i]) offsets.push_back(uint32_t(i)), bytes.push_back(fresh[i]);
  ASSERT_FALSE(offsets.empty());
  ASSERT_LT(offsets.front(), old_case.swa.bytes.size()) << "the window's record changed";
  ASSERT_GE(offsets.back(), old_case.swa.bytes.size()) << "the extra list's record changed";

  for (const Path path : {Path::kDecode, Path::kDecode8, Path::kDecode16}) {
    SCOPED_TRACE(path_name(path));
    SparseAttentionCuda attn(limits_for(1, path));
    DeviceCase want_dc(new_case), old_dc(old_case);
    ASSERT_GT(attn.decode_splits(want_dc.p), 0);
    std::vector<uint16_t> want, was, got;
    std::vector<float> want_lse, was_lse, got_lse;
    want_dc.plan_run_download(attn, want, want_lse);
    old_dc.plan_run_download(attn, was, was_lse);
    ASSERT_NE(std::memcmp(want.data(), was.data(), want.size() * 2), 0) << "the new records must matter";
    // One buffer for both caches, so that one kernel writes them.
    uint8_t* caches = old_dc.upload(both);
    SparseAttentionParams p = old_dc.p;
    p.swa_cache.base = caches;
    p.extra_cache.base = caches + old_case.swa.bytes.size();
    const uint32_t* d_offsets = old_dc.upload(offsets);
    const uint8_t* d_bytes = old_dc.upload(bytes);
    cudaStream_t stream = nullptr;
    DSV4_CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    old_dc.poison(stream);
    attn.plan(p, stream);
    late_writes_kernel<<<1, 256, 0, stream>>>(caches, d_offsets, d_bytes, int(offsets.size()), 50000);
    attn.run(p, stream, 0, {}, ListsReady{true, true, true});
    const cudaError_t e = cudaStreamSynchronize(stream);
    cudaStreamDestroy(stream);
    ASSERT_EQ(e, cudaSuccess) << cudaGetErrorString(e);
    old_dc.download(got, got_lse);
    EXPECT_EQ(std::memcmp(want.data(), got.data(), want.size() * 2), 0);
    EXPECT_EQ(std::memcmp(want_lse.data(), got_lse.data(), want_lse.size() * 4), 0);
  }
}

// ---- graph capture, determinism, plan slots, errors ---------------------------

// spec: a call, on the kernel `path` takes for it.
void check_graph_replay(const CaseSpec& spec, Path path) {
  const HostCase hc = make_case(spec);
  DeviceCase dc(hc);
  SparseAttentionCuda attn(limits_for(spec.tokens, path));
  ASSERT_EQ(attn.decode_splits(dc.p) > 0, is_decode(path));
  cudaStream_t s;
  DSV4_CUDA_OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  dc.poison(s);
  attn.plan(dc.p, s);
  attn.run(dc.p, s);
  DSV4_CUDA_OK(cudaStreamSynchronize(s));
  std::vector<uint16_t> eager_out, out;
  std::vector<float> eager_lse, lse;
  dc.download(eager_out, eager_lse);

  cudaGraph_t graph;
  cudaGraphExec_t exec;
  DSV4_CUDA_OK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
  attn.plan(dc.p, s);
  attn.run(dc.p, s);
  attn.run(dc.p, s);  // a second layer reusing the plan
  DSV4_CUDA_OK(cudaStreamEndCapture(s, &graph));
  DSV4_CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
  for (int rep = 0; rep < 3; ++rep) {
    dc.poison(s);
    DSV4_CUDA_OK(cudaGraphLaunch(exec, s));
    DSV4_CUDA_OK(cudaStreamSynchronize(s));
    dc.download(out, lse);
    EXPECT_EQ(std::memcmp(out.data(), eager_out.data(), out.size() * 2), 0) << "replay " << rep;
    EXPECT_EQ(std::memcmp(lse.data(), eager_lse.data(), lse.size() * 4), 0) << "replay " << rep;
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(s);
  const CompareStats st = compare(reference(hc.params()), out, lse, spec.tokens, spec.heads);
  EXPECT_EQ(st.bad_rows + st.bad_lse, 0) << st.first_failure;
}

TEST_F(SparseAttentionCudaTest, GraphCaptureReplayMatchesEagerBitwise) {
  check_graph_replay({.tokens = 8, .heads = 128, .extra_width = 1024, .extra_page = 2, .seed = 30}, Path::kTiles);
  check_graph_replay({.tokens = 4, .heads = 64, .extra_width = 512, .extra_page = 64, .seed = 33}, Path::kDecode);
  check_graph_replay({.tokens = 4, .heads = 64, .extra_width = 512, .extra_page = 64, .seed = 33}, Path::kDecode8);
  check_graph_replay({.tokens = 1, .heads = 64, .extra_width = 512, .extra_page = 64, .seed = 35}, Path::kDecode16);
}

// A plain kernel queued right after run() must see the finished output:
// both of run()'s kernels are launched to overlap their predecessor, and
// the stream order after them must still hold (with and without split rows).
__global__ void copy_words(const uint32_t* src, uint32_t* dst, size_t n) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) dst[i] = src[i];
}

TEST_F(SparseAttentionCudaTest, KernelAfterRunSeesTheOutput) {
  for (const int extra : {0, 8192, 512}) {  // whole units only / rows split over many CTAs / the decode kernel
    const HostCase hc = make_case({.tokens = extra ? 2 : 200, .heads = 64, .extra_width = extra, .extra_page = 2, .seed = 41});
    DeviceCase dc(hc);
    SparseAttentionCuda attn({hc.spec.tokens, 64, 1});
    uint32_t* copy = nullptr;
    const size_t words = dc.out_elems / 2;
    DSV4_CUDA_OK(cudaMalloc(&copy, words * 4));
    for (int rep = 0; rep < 3; ++rep) {
      dc.poison(nullptr);
      attn.plan(dc.p, nullptr);
      attn.run(dc.p, nullptr);
      copy_words<<<264, 256>>>(reinterpret_cast<const uint32_t*>(dc.p.out), copy, words);
      DSV4_CUDA_OK(cudaDeviceSynchronize());
      std::vector<uint16_t> out, copied(dc.out_elems);
      std::vector<float> lse;
      dc.download(out, lse);
      DSV4_CUDA_OK(cudaMemcpy(copied.data(), copy, words * 4, cudaMemcpyDeviceToHost));
      EXPECT_EQ(std::memcmp(out.data(), copied.data(), out.size() * 2), 0) << "extra " << extra << ", rep " << rep;
    }
    cudaFree(copy);
  }
}

// Many split units, merged by the combine kernel (or in the decode kernel's
// clusters) each call: any race or order dependence in the merge would
// show as a difference.
void check_repeated_runs(const CaseSpec& spec, Path path) {
  const HostCase hc = make_case(spec);
  DeviceCase dc(hc);
  SparseAttentionCuda attn(limits_for(spec.tokens, path));
  ASSERT_EQ(attn.decode_splits(dc.p) > 0, is_decode(path));
  attn.plan(dc.p, nullptr);
  std::vector<uint16_t> first_out, out;
  std::vector<float> first_lse, lse;
  for (int rep = 0; rep < 20; ++rep) {
    dc.poison();
    attn.run(dc.p, nullptr);
    DSV4_CUDA_OK(cudaDeviceSynchronize());
    dc.download(out, lse);
    if (rep == 0) {
      first_out = out;
      first_lse = lse;
      continue;
    }
    ASSERT_EQ(std::memcmp(out.data(), first_out.data(), out.size() * 2), 0) << "rep " << rep;
    ASSERT_EQ(std::memcmp(lse.data(), first_lse.data(), lse.size() * 4), 0) << "rep " << rep;
  }
  const CompareStats st = compare(reference(hc.params()), out, lse, spec.tokens, spec.heads);
  EXPECT_EQ(st.bad_rows + st.bad_lse, 0) << st.first_failure;
}

TEST_F(SparseAttentionCudaTest, RepeatedRunsWithOnePlanAreBitwiseEqual) {
  check_repeated_runs({.tokens = 3, .heads = 64, .extra_width = 8192, .extra_page = 2, .seed = 31}, Path::kTiles);
  check_repeated_runs({.tokens = 3, .heads = 128, .extra_width = 512, .extra_page = 2, .seed = 34}, Path::kDecode);
  check_repeated_runs({.tokens = 3, .heads = 128, .extra_width = 512, .extra_page = 2, .seed = 34}, Path::kDecode16);
}

TEST_F(SparseAttentionCudaTest, PlanSlotsAreIndependent) {
  const HostCase a = make_case({.tokens = 5, .heads = 64, .extra_width = 1024, .extra_page = 2, .seed = 40});
  const HostCase b = make_case({.tokens = 5, .heads = 64, .extra_width = 1024, .extra_page = 2, .seed = 41});
  DeviceCase da(a), db(b);
  SparseAttentionCuda attn({5, 64, 2});
  attn.plan(da.p, nullptr, 0);
  attn.plan(db.p, nullptr, 1);
  for (int rep = 0; rep < 2; ++rep) {
    da.poison();
    db.poison();
    attn.run(da.p, nullptr, 0);
    attn.run(db.p, nullptr, 1);
  }
  DSV4_CUDA_OK(cudaDeviceSynchronize());
  for (const auto* c : {&a, &b}) {
    std::vector<uint16_t> out;
    std::vector<float> lse;
    (c == &a ? da : db).download(out, lse);
    const CompareStats st = compare(reference(c->params()), out, lse, 5, 64);
    EXPECT_EQ(st.bad_rows + st.bad_lse, 0) << st.first_failure;
  }
}

// Padded tokens (plan's real_tokens, a device int): on the tile kernel they
// get no work and their rows of out and lse keep the poison; the real rows
// are the reference's, whatever the count (none, some, all, past the call).
// The decode kernel writes every row regardless.
TEST_F(SparseAttentionCudaTest, PaddedTokensAreNotWrittenOnTheTileKernel) {
  int32_t* real = nullptr;
  DSV4_CUDA_OK(cudaMalloc(&real, sizeof(int32_t)));
  auto check = [&](const CaseSpec& spec, Path path, int r, int written) {
    SCOPED_TRACE(std::string(path_name(path)) + ", real tokens " + std::to_string(r));
    const HostCase hc = make_case(spec);
    DeviceCase dc(hc);
    SparseAttentionCuda attn(limits_for(spec.tokens, path));
    ASSERT_EQ(attn.decode_splits(dc.p) > 0, is_decode(path));
    DSV4_CUDA_OK(cudaMemcpy(real, &r, sizeof r, cudaMemcpyHostToDevice));
    dc.poison();
    attn.plan(dc.p, nullptr, 0, real);
    attn.run(dc.p, nullptr);
    DSV4_CUDA_OK(cudaDeviceSynchronize());
    EXPECT_TRUE(dc.guards_intact());
    std::vector<uint16_t> out;
    std::vector<float> lse;
    dc.download(out, lse);
    const CompareStats st = compare(reference(hc.params()), out, lse, written, spec.heads);
    EXPECT_EQ(st.bad_rows + st.bad_lse, 0) << st.first_failure;
    size_t touched = 0;
    for (size_t i = size_t(written) * spec.heads * kKvDim; i < out.size(); ++i) touched += out[i] != 0xFFFF;
    for (size_t i = size_t(written) * spec.heads; i < lse.size(); ++i) {
      uint32_t bits = 0;
      std::memcpy(&bits, &lse[i], 4);
      touched += bits != 0xFFFFFFFFu;
    }
    EXPECT_EQ(touched, 0u) << "padded rows written";
  };
  const CaseSpec tiles{.tokens = 40, .heads = 64, .extra_width = 512, .extra_page = 64, .seed = 61};
  for (const int r : {29, 0, 1, 40, 57}) check(tiles, Path::kTiles, r, std::min(r, 40));
  check({.tokens = 4, .heads = 64, .extra_width = 512, .extra_page = 2, .seed = 62}, Path::kDecode, 2, 4);
  cudaFree(real);
}

// e4m3 0x7f is NaN; the CPU decode gives NaN, so must the GPU. Only the
// token that attends the entry is affected. Entries 5 and 40 are gathered
// by different warpgroups; bytes 100 and 30 fall in record steps that the
// two CTAs of a pair (H = 128) dequantize separately.
void check_nan_code(int heads, int byte, Path path) {
  HostCase hc = make_case({.tokens = 4, .heads = heads, .ragged = false, .hole_rate = 0, .oor_rate = 0, .seed = 50});
  for (int pos : {5, 40}) {
    const int32_t slot = hc.swa_idx[size_t(2) * 128 + pos];  // token 2
    for (int t = 0; t < 4; ++t)
      for (int i = 0; i < 128; ++i)
        if (t != 2 && hc.swa_idx[size_t(t) * 128 + i] == slot) hc.swa_idx[size_t(t) * 128 + i] = -1;
    uint8_t* page = hc.swa.bytes.data() + size_t(slot / 64) * hc.swa.stride();
    page[fp8_ds_mla_data_offset(slot % 64) + byte + (pos == 40 ? 64 : 0)] = 0x7f;
  }
  DeviceCase dc(hc);
  SparseAttentionCuda attn(limits_for(4, path));
  ASSERT_EQ(attn.decode_splits(dc.p) > 0, is_decode(path));
  std::vector<uint16_t> out;
  std::vector<float> lse;
  dc.plan_run_download(attn, out, lse);
  const Reference ref = reference(hc.params());
  for (int h = 0; h < heads; ++h) {
    EXPECT_TRUE(std::isnan(ref.out[(size_t(2) * heads + h) * 512]));
    EXPECT_TRUE(std::isnan(bf16_to_float(out[(size_t(2) * heads + h) * 512]))) << "head " << h << " byte " << byte;
  }
  for (int t : {0, 1, 3}) {
    for (int h = 0; h < heads; ++h)
      for (int d = 0; d < 512; ++d)
        ASSERT_FALSE(std::isnan(bf16_to_float(out[(size_t(t) * heads + h) * 512 + d]))) << "token " << t << " byte " << byte;
  }
}

// ---- the output rotation fused into the output writes -------------------------

// run() with an OutputRope (its table from out_rope_table_cuda) must give,
// bit for bit, run() followed by the output path's own kernel (out_rope.h),
// on whole units (the attention kernel's writes) and split ones (the
// combine's). Positions span 0 ..
// 1,048,575; the check that the rotation changed the output keeps the
// comparison from passing on two unrotated outputs.
void check_fused_output_rope(const CaseSpec& spec, Path path = Path::kTiles) {
  const HostCase hc = make_case(spec);
  DeviceCase dc(hc);
  SparseAttentionCuda attn(limits_for(spec.tokens, path));
  ASSERT_EQ(attn.decode_splits(dc.p) > 0, is_decode(path));
  std::mt19937_64 rng(spec.seed);
  std::vector<int32_t> pos(size_t(spec.tokens));
  for (int32_t& x : pos) x = int32_t(rng() % 1048576);
  pos[0] = 1048575;
  const int32_t* d_pos = dc.upload(pos);
  const Rope rope(RopeParams{160000, false, YarnParams{}});
  float* table = dc.upload(std::vector<float>(size_t(spec.tokens) * 64));
  cuda::out_rope_table_cuda(d_pos, spec.tokens, rope, table, nullptr);
  std::vector<uint16_t> plain, separate, fused;
  std::vector<float> plain_lse, separate_lse, fused_lse;
  dc.plan_run_download(attn, plain, plain_lse);
  cuda::out_inverse_rope_cuda(cuda::OutInverseRopeParams{spec.tokens, spec.heads, dc.p.out, int64_t(spec.heads) * 512,
                                                          d_pos, &rope},
                              nullptr);
  DSV4_CUDA_OK(cudaDeviceSynchronize());
  dc.download(separate, separate_lse);
  dc.poison();
  attn.run(dc.p, nullptr, 0, OutputRope{table});
  DSV4_CUDA_OK(cudaDeviceSynchronize());
  EXPECT_TRUE(dc.guards_intact()) << "a call wrote past its outputs";
  dc.download(fused, fused_lse);
  size_t rotated = 0, first_diff = fused.size();
  for (size_t i = 0; i < fused.size(); ++i) {
    rotated += separate[i] != plain[i];
    if (fused[i] != separate[i] && first_diff == fused.size()) first_diff = i;
  }
  EXPECT_GT(rotated, fused.size() / 40) << "the rotation changed too little to test anything";
  EXPECT_EQ(first_diff, fused.size()) << "first difference at token " << first_diff / (spec.heads * 512) << ", head "
                                      << first_diff / 512 % spec.heads << ", dim " << first_diff % 512;
  EXPECT_EQ(std::memcmp(fused_lse.data(), plain_lse.data(), fused_lse.size() * 4), 0) << "lse changed";
  std::printf("    tokens %d heads %d: %zu of %zu output values rotated\n", spec.tokens, spec.heads, rotated, fused.size());
}

TEST_F(SparseAttentionCudaTest, FusedOutputRopeMatchesItsOwnKernel) {
  check_fused_output_rope({.tokens = 2, .heads = 64, .extra_width = 8192, .extra_page = 2, .seed = 70});  // split
  check_fused_output_rope({.tokens = 200, .heads = 64, .seed = 71});                                    // whole
  check_fused_output_rope({.tokens = 40, .heads = 128, .extra_width = 1024, .extra_page = 2, .empty_rows = 5,
                           .seed = 72});  // clusters, mixed, empty rows
  check_fused_output_rope({.tokens = 9, .heads = 96, .extra_width = 512, .seed = 73});  // a partial head block
  // The decode kernel's merge: one split, eight, a padded group.
  check_fused_output_rope({.tokens = 1, .heads = 64, .swa_width = 32, .seed = 74}, Path::kDecode);
  check_fused_output_rope({.tokens = 5, .heads = 128, .extra_width = 512, .extra_page = 2, .empty_rows = 1, .seed = 75},
                          Path::kDecode);
  check_fused_output_rope({.tokens = 9, .heads = 96, .extra_width = 512, .seed = 73}, Path::kDecode);
  check_fused_output_rope({.tokens = 9, .heads = 96, .extra_width = 512, .seed = 73}, Path::kDecode8);
  check_fused_output_rope({.tokens = 1, .heads = 64, .swa_width = 32, .seed = 74}, Path::kDecode16);
  check_fused_output_rope({.tokens = 5, .heads = 128, .extra_width = 512, .extra_page = 2, .empty_rows = 1, .seed = 75},
                          Path::kDecode16);
}

TEST_F(SparseAttentionCudaTest, NanCodeInAnAttendedEntryGivesNan) {
  for (int heads : {64, 128})
    for (int byte : {100, 30})
      for (const Path path : {Path::kDecode, Path::kDecode8, Path::kDecode16, Path::kTiles}) check_nan_code(heads, byte, path);
}

TEST_F(SparseAttentionCudaTest, ZeroTokensIsANoOp) {
  SparseAttentionCuda attn({4, 64, 1});
  SparseAttentionParams p;
  attn.plan(p, nullptr);
  attn.run(p, nullptr);
  DSV4_CUDA_OK(cudaDeviceSynchronize());
}

TEST_F(SparseAttentionCudaTest, BadCallsThrowBeforeLaunching) {
  const HostCase hc = make_case({.tokens = 4, .heads = 64, .seed = 60});
  DeviceCase dc(hc);
  SparseAttentionCuda attn({4, 64, 1});
  EXPECT_THROW(attn.run(dc.p, nullptr), Error);  // no plan yet
  SparseAttentionParams p = dc.p;
  p.num_heads = 128;  // above max_heads
  EXPECT_THROW(attn.plan(p, nullptr), Error);
  p = dc.p;
  p.num_tokens = 5;  // above max_tokens
  EXPECT_THROW(attn.plan(p, nullptr), Error);
  p = dc.p;
  p.swa_cache.page_stride = 100;
  EXPECT_THROW(attn.plan(p, nullptr), Error);
  p = dc.p;
  p.softmax_scale = 0.0f;
  EXPECT_THROW(attn.plan(p, nullptr), Error);
  p = dc.p;
  p.q = reinterpret_cast<const uint16_t*>(reinterpret_cast<uintptr_t>(dc.p.q) + 2);  // misaligned
  EXPECT_THROW(attn.plan(p, nullptr), Error);
  attn.plan(dc.p, nullptr);
  p = dc.p;
  p.num_tokens = 3;  // plan was built for 4
  EXPECT_THROW(attn.run(p, nullptr), Error);
  EXPECT_THROW(attn.run(dc.p, nullptr, 1), Error);  // no such slot
  attn.run(dc.p, nullptr);
  DSV4_CUDA_OK(cudaDeviceSynchronize());
}

}  // namespace
}  // namespace dsv4::test
