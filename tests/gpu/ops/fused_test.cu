// The fused elementwise ops on the GPU against their CPU twins, built from the
// functions the CPU layer runs (rms_norm, rms_norm_bf16_arith, Rope::apply,
// round_bf16, quantize_e4m3_block, fp8_ds_mla_encode) on the same random
// inputs: bf16 outputs, FP8 codes and scales and cache bytes compared bit for
// bit. Outputs are poisoned (NaN bytes) before a run, guard zones after every
// buffer are checked, and caches are compared whole, so a stray or missing
// write fails. Where the CPU and the GPU may legitimately round differently
// (fused_support.cuh: rms_tie_risk), the row is compared within one rounding
// step instead, and counted. Every test skips itself without a CUDA device
// (FusedChecks need none).
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdio>
#include <initializer_list>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "attn/cuda/act_quant.cuh"
#include "attn/cuda/out_rope.h"
#include "attn/cuda/q_head_norm_rope.h"
#include "attn/cuda/qkv_norm_rope.h"
#include "attn/cuda/residual_norm.h"
#include "attn/cuda/warp.cuh"
#include "cache/fp8_ds_mla.h"
#include "common/error.h"
#include "fused_support.cuh"
#include "numerics/bf16.h"
#include "numerics/e4m3.h"
#include "numerics/quant.h"
#include "numerics/rmsnorm.h"
#include "numerics/rope.h"

namespace dsv4::test::fused {
namespace {

using cuda::Fp8ActOut;

constexpr float kEps = 1e-6f;
constexpr uint16_t kPoisonBf16 = 0xffff;  // a NaN

// ---- FP8 activations: the CPU's codes, compared per row ---------------------------

// Host image of an Fp8ActOut of `rows` x `cols`, poisoned (0xff: e4m3 NaN
// codes, NaN scales), plus the device buffers.
struct Fp8Image {
  int rows = 0, cols = 0;
  int64_t ld = 0, scale_ld = 0;
  std::vector<uint8_t> codes;
  std::vector<float> scales;

  Fp8Image(int rows_, int cols_, int ld_pad)
      : rows(rows_), cols(cols_), ld(cols_ + ld_pad), scale_ld(rows_ + 3),
        codes(size_t(rows_) * size_t(ld), 0xff),
        scales(size_t(cols_ / 128) * size_t(scale_ld), std::bit_cast<float>(0xffffffffu)) {}

  // Row m as quantize_e4m3_block writes it, block by block.
  void set_row(int m, const float* x) {
    for (int kb = 0; kb < cols / 128; ++kb) {
      const int e = quantize_e4m3_block(x + 128 * kb, 128, codes.data() + size_t(m) * ld + 128 * kb);
      scales[size_t(kb) * scale_ld + m] = exp2_int(e);
    }
  }
  // Row m taken from another image (a row where rounding may differ).
  void copy_row(int m, const Fp8Image& o) {
    std::memcpy(codes.data() + size_t(m) * ld, o.codes.data() + size_t(m) * ld, size_t(cols));
    for (int kb = 0; kb < cols / 128; ++kb) scales[size_t(kb) * scale_ld + m] = o.scales[size_t(kb) * scale_ld + m];
  }
  // Dequantized element (m, k).
  float value(int m, int k) const {
    return e4m3_to_float(codes[size_t(m) * ld + k]) * scales[size_t(k / 128) * scale_ld + m];
  }
};

struct Fp8Device {
  DeviceArray<uint8_t> codes;
  DeviceArray<float> scales;
  explicit Fp8Device(const Fp8Image& img) : codes(img.codes), scales(img.scales) {}
  Fp8ActOut out(const Fp8Image& img) const {
    return Fp8ActOut{codes.get(), scales.get(), img.rows, img.cols, img.ld, img.scale_ld};
  }
  void download(Fp8Image& img) const {
    img.codes = codes.download();
    img.scales = scales.download();
  }
};

// Both images equal bit for bit; names the first difference.
void expect_fp8_equal(const Fp8Image& want, const Fp8Image& got, const std::string& what) {
  const int64_t c = first_diff(want.codes, got.codes);
  EXPECT_EQ(c, -1) << what << ": first FP8 code difference at row " << c / want.ld << " col " << c % want.ld
                   << ": want " << hex(want.codes[size_t(std::max<int64_t>(c, 0))]) << " got "
                   << hex(got.codes[size_t(std::max<int64_t>(c, 0))]);
  const int64_t s = first_diff(want.scales, got.scales);
  EXPECT_EQ(s, -1) << what << ": first FP8 scale difference at block " << s / want.scale_ld << " row "
                   << s % want.scale_ld << ": want " << want.scales[size_t(std::max<int64_t>(s, 0))] << " got "
                   << got.scales[size_t(std::max<int64_t>(s, 0))];
}

// |got - want| within one bf16 step of want (and finite): the bound for a row
// whose RMSNorm factor may round to a neighbouring float (then every product
// moves by about 2^-24 relative, and a bf16 rounding may flip by one step).
bool within_bf16_step(float want, float got) {
  return std::isfinite(got) && std::fabs(got - want) <= std::ldexp(std::fabs(want), -7) + 1e-30f;
}

// ---- fp8_ds_mla caches --------------------------------------------------------------

// Where byte `off` of a cache of fp8_ds_mla pages lies, in words.
std::string fp8_ds_mla_where(int64_t off, size_t stride, int B) {
  const int64_t page = off / int64_t(stride), in = off % int64_t(stride);
  std::string s = "byte " + std::to_string(off) + " (page " + std::to_string(page) + ", ";
  if (in < int64_t(kKvEntryDataBytes) * B)
    return s + "entry " + std::to_string(in / kKvEntryDataBytes) + " data byte " +
           std::to_string(in % kKvEntryDataBytes) + ")";
  if (in < int64_t(kKvEntryBytes) * B)
    return s + "entry " + std::to_string((in - kKvEntryDataBytes * B) / 8) + " scale byte " +
           std::to_string((in - kKvEntryDataBytes * B) % 8) + ")";
  return s + "page padding)";
}

// Copies entry t of page p from `from` into `to` (a record where rounding may differ).
void copy_fp8_ds_mla_record(std::vector<uint8_t>& to, const std::vector<uint8_t>& from, size_t stride, int B,
                            int64_t page, int t) {
  const size_t base = size_t(page) * stride;
  std::memcpy(to.data() + base + fp8_ds_mla_data_offset(t), from.data() + base + fp8_ds_mla_data_offset(t),
              kKvEntryDataBytes);
  std::memcpy(to.data() + base + fp8_ds_mla_scale_offset(B, t), from.data() + base + fp8_ds_mla_scale_offset(B, t),
              kKvEntryScaleBytes);
}

// The decoded records agree within one e4m3 step (12.5%) or one bf16 step.
bool fp8_ds_mla_records_close(const uint8_t* want_page, const uint8_t* got_page, int B, int t) {
  float a[kKvDim], b[kKvDim];
  fp8_ds_mla_decode(want_page, B, t, a);
  fp8_ds_mla_decode(got_page, B, t, b);
  for (int i = 0; i < kKvDim; ++i)
    if (!std::isfinite(b[i]) || std::fabs(a[i] - b[i]) > 0.125f * std::fabs(a[i]) + 1e-30f) return false;
  return true;
}

// ---- the q/kv kernel -------------------------------------------------------------------

struct QkvSpec {
  int tokens = 8;
  int q_lora = 1024;
  int ld_pad = 12;           // extra bf16 per qkv row (a multiple of 4)
  int64_t pages = 16;        // SWA pages of 64 entries
  bool big = false;          // slots in pages past 2 GiB; arena filled with a byte pattern
  double hole_rate = 0.15;   // tokens with slot -1
  uint64_t seed = 1;
  int per_cta = 0;           // tokens a CTA (0: the launcher's choice by size)
  int expect_per_cta = 1;    // what the launcher takes (1: a CTA a token; 2, 4, 8: a warp a token)
  bool cq = true;            // ask for the bf16 cq (the layer asks only for its FP8 form)
};

void run_qkv(const QkvSpec& s) {
  std::mt19937_64 rng(s.seed);
  const Rope rope = compressed_rope();
  const int T = s.tokens, R = s.q_lora, B = 64;
  const int64_t ld = R + kKvDim + s.ld_pad, cq_ld = R + 8;
  const size_t stride = fp8_ds_mla_page_stride(B);
  const int64_t cap = s.pages * B;

  // Inputs: bf16 projections, norm weights, positions (the last three of the
  // context first), slots (distinct; -1 holes; the last token past the capacity).
  const std::vector<uint16_t> qkv = random_bf16_bits(rng, size_t(T) * size_t(ld), -6, 3);
  const std::vector<float> q_norm = random_norm_weight(rng, size_t(R)), kv_norm = random_norm_weight(rng, kKvDim);
  int redraws = 0;
  std::vector<int32_t> pos(static_cast<size_t>(T));
  for (int t = 0; t < T; ++t)
    pos[size_t(t)] =
        t < 3 ? safe_position_at_most(1048575 - t, rope, redraws) : draw_position(rng, 0, 1048575, rope, redraws);
  // Slots past 2^31 bytes when `big`: pages from 2^31 / stride on.
  const int64_t low_page = s.big ? int64_t((size_t(1) << 31) / stride) + 1 : 0;
  std::set<int32_t> used;
  std::vector<int32_t> slot(static_cast<size_t>(T));
  for (int t = 0; t < T; ++t) {
    if (std::uniform_real_distribution<double>(0, 1)(rng) < s.hole_rate) {
      slot[size_t(t)] = -1;
      continue;
    }
    int32_t v;
    do {
      const int64_t page = low_page + int64_t(rng() % uint64_t(s.pages - low_page));
      v = int32_t(page * B + int64_t(rng() % B));
    } while (!used.insert(v).second);
    slot[size_t(t)] = v;
  }
  if (T >= 4) slot[size_t(T - 1)] = int32_t(cap);  // past the capacity: writes nothing

  // The CPU twin.
  std::vector<uint8_t> arena(stride * size_t(s.pages));
  if (s.big) {
    std::fill(arena.begin(), arena.end(), uint8_t(0xa5));
  } else {
    for (auto& b : arena) b = uint8_t(rng());
  }
  std::vector<uint8_t> arena_want = arena;
  std::vector<uint16_t> cq_want(size_t(T) * size_t(cq_ld), kPoisonBf16);
  Fp8Image fp8_want(T + 2, R, 16);
  std::vector<bool> q_risk(static_cast<size_t>(T)), kv_risk(static_cast<size_t>(T));
  for (int t = 0; t < T; ++t) {
    std::vector<float> q = bf16_to_floats(qkv.data() + size_t(t) * size_t(ld), size_t(R));
    std::vector<float> kv = bf16_to_floats(qkv.data() + size_t(t) * size_t(ld) + R, kKvDim);
    q_risk[size_t(t)] = rms_tie_risk(q.data(), R);
    kv_risk[size_t(t)] = rms_tie_risk(kv.data(), kKvDim);
    rms_norm(q.data(), q_norm.data(), R, kEps, q.data());
    round_bf16(q.data(), size_t(R));
    for (int i = 0; i < R; ++i) cq_want[size_t(t) * size_t(cq_ld) + size_t(i)] = bf16_bits(q[size_t(i)]);
    fp8_want.set_row(t, q.data());
    rms_norm(kv.data(), kv_norm.data(), kKvDim, kEps, kv.data());
    round_bf16(kv.data(), kKvDim);
    rope.apply(kv.data() + kNopeDim, pos[size_t(t)]);
    round_bf16(kv.data() + kNopeDim, kRopeDim);
    const int64_t sl = slot[size_t(t)];
    if (sl >= 0 && sl < cap) fp8_ds_mla_encode(kv.data(), arena_want.data() + size_t(sl / B) * stride, B, int(sl % B));
  }

  // The GPU.
  DeviceArray<uint16_t> d_qkv(qkv), d_cq(cq_want.size());
  d_cq.fill_bytes(0xff);
  DeviceArray<float> d_qn(q_norm), d_kvn(kv_norm);
  DeviceArray<int32_t> d_pos(pos);
  DeviceArray<int32_t> d_slot(slot);
  Fp8Image fp8_got(T + 2, R, 16);  // poisoned
  Fp8Device d_fp8(fp8_got);
  DeviceBytes d_arena(arena.size());
  if (s.big)
    d_arena.fill(0xa5);
  else
    d_arena.upload(arena.data(), arena.size());

  cuda::QkvNormRopeParams p;
  p.num_tokens = T;
  p.q_lora = R;
  p.qkv = d_qkv.get();
  p.qkv_ld = ld;
  p.q_norm = d_qn.get();
  p.kv_norm = d_kvn.get();
  p.eps = kEps;
  p.positions = d_pos.get();
  p.rope = &rope;
  p.cq = s.cq ? d_cq.get() : nullptr;
  p.cq_ld = cq_ld;
  p.cq_fp8 = d_fp8.out(fp8_got);
  p.swa = KvPagesMut{d_arena.get(), s.pages, B, stride};
  p.swa_slot = d_slot.get();
  p.tokens_per_cta = s.per_cta;
  ASSERT_EQ(cuda::qkv_norm_rope_tokens_per_cta(p), s.expect_per_cta) << "not the kernel this case is for";
  cuda::qkv_norm_rope_cuda(p, nullptr);
  sync_and_check("qkv_norm_rope");

  std::vector<uint16_t> cq_got = d_cq.download();
  d_fp8.download(fp8_got);
  // Without cq its buffer keeps the 0xff poison: nothing was written there.
  if (!s.cq) cq_want.assign(cq_want.size(), uint16_t(0xffff));
  std::vector<uint8_t> arena_got = d_arena.download();

  // Rows where rounding may differ: within one step, then taken as they are.
  int q_risky = 0, kv_risky = 0;
  for (int t = 0; t < T; ++t) {
    if (q_risk[size_t(t)]) {
      ++q_risky;
      for (int i = 0; i < R; ++i) {
        const size_t k = size_t(t) * size_t(cq_ld) + size_t(i);
        ASSERT_TRUE(!s.cq || within_bf16_step(bf16_to_float(cq_want[k]), bf16_to_float(cq_got[k])))
            << "risky cq row " << t << " col " << i;
        ASSERT_TRUE(within_bf16_step(fp8_want.value(t, i), fp8_got.value(t, i)) ||
                    std::fabs(fp8_want.value(t, i) - fp8_got.value(t, i)) <= 0.125f * std::fabs(fp8_want.value(t, i)))
            << "risky FP8 row " << t << " col " << i;
        if (s.cq) cq_want[k] = cq_got[k];
      }
      fp8_want.copy_row(t, fp8_got);
    }
    const int64_t sl = slot[size_t(t)];
    if (kv_risk[size_t(t)] && sl >= 0 && sl < cap) {
      ++kv_risky;
      const size_t page = size_t(sl / B) * stride;
      ASSERT_TRUE(fp8_ds_mla_records_close(arena_want.data() + page, arena_got.data() + page, B, int(sl % B)))
          << "risky kv record of token " << t;
      copy_fp8_ds_mla_record(arena_want, arena_got, stride, B, sl / B, int(sl % B));
    }
  }
  std::printf("    qkv: T %d q_lora %d, %d position redraws, %d/%d rows with a norm tie risk (q/kv)\n", T, R, redraws,
              q_risky, kv_risky);

  const int64_t c = first_diff(cq_want, cq_got);
  EXPECT_EQ(c, -1) << "cq: first difference at token " << c / cq_ld << " col " << c % cq_ld << ": want "
                   << hex(cq_want[size_t(std::max<int64_t>(c, 0))]) << " got "
                   << hex(cq_got[size_t(std::max<int64_t>(c, 0))]);
  expect_fp8_equal(fp8_want, fp8_got, "cq_fp8");
  const int64_t a = first_diff(arena_want.data(), arena_got.data(), arena.size());
  EXPECT_EQ(a, -1) << "SWA cache: first difference at " << fp8_ds_mla_where(a, stride, B) << ": want "
                   << hex(arena_want[size_t(std::max<int64_t>(a, 0))]) << " got "
                   << hex(arena_got[size_t(std::max<int64_t>(a, 0))]);
  EXPECT_EQ(d_cq.guard_damage(), -1) << "write past cq";
  EXPECT_EQ(d_fp8.codes.guard_damage(), -1) << "write past the FP8 codes";
  EXPECT_EQ(d_fp8.scales.guard_damage(), -1) << "write past the FP8 scales";
  EXPECT_EQ(d_arena.guard_damage(), -1) << "write past the SWA cache";
}

class QkvNormRope : public DeviceTest {};

TEST_F(QkvNormRope, FlashDecodeBatch) { run_qkv({8, 1024, 12, 16, false, 0.15, 11}); }
TEST_F(QkvNormRope, FlashOneToken) { run_qkv({1, 1024, 0, 2, false, 0.0, 12}); }
// From 512 tokens a warp takes a token, two a CTA (from 4,096 eight); the
// last CTAs here take fewer.
TEST_F(QkvNormRope, FlashPrefillChunk) { run_qkv({515, 1024, 8, 24, false, 0.1, 13, 0, 2}); }
TEST_F(QkvNormRope, WarpsEightACta) { run_qkv({1027, 1024, 0, 20, false, 0.1, 18, 8, 8}); }
TEST_F(QkvNormRope, WarpsFourACta) { run_qkv({1030, 1024, 16, 20, false, 0.05, 19, 4, 4}); }
TEST_F(QkvNormRope, WarpsLongChunk) { run_qkv({4099, 1024, 8, 72, false, 0.05, 25, 0, 8}); }
TEST_F(QkvNormRope, TwoWarpsACtaPro) { run_qkv({7, 1536, 8, 4, false, 0.2, 20, 2, 2}); }
TEST_F(QkvNormRope, EightWarpsACtaPro) { run_qkv({13, 1536, 0, 4, false, 0.0, 21, 8, 8}); }
TEST_F(QkvNormRope, WarpsAllSlotsEmpty) { run_qkv({9, 1024, 0, 2, false, 1.0, 28, 2, 2}); }
TEST_F(QkvNormRope, WarpsPagesPast2GiB) { run_qkv({40, 1024, 0, 57600, true, 0.0, 26, 8, 8}); }
// Shapes the warp kernel does not take run a CTA a token whatever is asked:
// rows not 16-byte aligned, a q_lora it has no instantiation for.
TEST_F(QkvNormRope, MisalignedRowsAskedForWarps) { run_qkv({300, 1024, 4, 16, false, 0.1, 27, 8, 1}); }
TEST_F(QkvNormRope, LargestQLoraAskedForWarps) { run_qkv({6, 3584, 8, 2, false, 0.0, 23, 4, 1}); }
TEST_F(QkvNormRope, ProSizes) { run_qkv({5, 1536, 0, 4, false, 0.0, 14}); }
TEST_F(QkvNormRope, LargestQLora) { run_qkv({3, 3584, 8, 2, false, 0.0, 15}); }
TEST_F(QkvNormRope, AllSlotsEmpty) { run_qkv({6, 1024, 0, 2, false, 1.0, 16}); }
// 57,600 pages of 37,440 bytes: 2.16 GB; the written pages start past 2^31 bytes.
TEST_F(QkvNormRope, PagesPast2GiB) { run_qkv({24, 1024, 0, 57600, true, 0.0, 17}); }

// As the layer calls it: the FP8 form of cq only (wq_b and the indexer's
// wq_b read nothing else), on both kernels; cq's buffer must stay untouched.
TEST_F(QkvNormRope, WarpsWithoutBf16Cq) {
  QkvSpec s{1030, 1024, 8, 20, false, 0.1, 29, 8, 8};
  s.cq = false;
  run_qkv(s);
}
TEST_F(QkvNormRope, DecodeWithoutBf16Cq) {
  QkvSpec s{8, 1024, 12, 16, false, 0.15, 30};
  s.cq = false;
  run_qkv(s);
}

TEST_F(QkvNormRope, ZeroTokensLaunchNothing) {
  const Rope rope = compressed_rope();
  DeviceBytes arena(fp8_ds_mla_page_stride(64));
  arena.fill(0x3c);
  cuda::QkvNormRopeParams p;
  p.num_tokens = 0;
  p.q_lora = 1024;
  p.rope = &rope;
  p.swa = KvPagesMut{arena.get(), 1, 64, fp8_ds_mla_page_stride(64)};
  cuda::qkv_norm_rope_cuda(p, nullptr);  // nothing else is needed for zero tokens
  sync_and_check("qkv_norm_rope, T = 0");
  const std::vector<uint8_t> got = arena.download();
  for (size_t i = 0; i < got.size(); ++i) ASSERT_EQ(got[i], 0x3c) << "byte " << i;
}

// ---- the q head kernel -------------------------------------------------------------------

struct QHeadSpec {
  int tokens = 4;
  int heads = 64;
  int ld_pad = 0;  // extra bf16 per row (a multiple of 8)
  bool swa = false;
  uint64_t seed = 1;
};

void run_q_head(const QHeadSpec& s) {
  std::mt19937_64 rng(s.seed);
  const Rope rope = s.swa ? swa_rope() : compressed_rope();
  const int T = s.tokens, H = s.heads;
  const int64_t ld = int64_t(H) * 512 + s.ld_pad;
  const std::vector<uint16_t> q = random_bf16_bits(rng, size_t(T) * size_t(ld), -5, 3);
  int redraws = 0;
  std::vector<int32_t> pos(static_cast<size_t>(T));
  // Token 0 at the edge of the context, token 1 at position 0, the others anywhere.
  for (int t = 0; t < T; ++t)
    pos[size_t(t)] = t == 0   ? safe_position_at_most(1048575, rope, redraws)
                     : t == 1 ? 0
                              : draw_position(rng, 1, 1048575, rope, redraws);

  std::vector<uint16_t> want = q;
  for (int t = 0; t < T; ++t) {
    for (int h = 0; h < H; ++h) {
      uint16_t* row = want.data() + size_t(t) * size_t(ld) + size_t(h) * 512;
      std::vector<float> x = bf16_to_floats(row, 512);
      rms_norm_bf16_arith(x.data(), 512, kEps);
      rope.apply(x.data() + kNopeDim, pos[size_t(t)]);
      round_bf16(x.data() + kNopeDim, kRopeDim);
      bool changed = false;
      for (int i = 0; i < 512; ++i) {
        changed |= row[i] != bf16_bits(x[size_t(i)]);
        row[i] = bf16_bits(x[size_t(i)]);
      }
      ASSERT_TRUE(changed) << "test data: row (" << t << ", " << h << ") does not change";
    }
  }

  DeviceArray<uint16_t> d_q(q);
  DeviceArray<int32_t> d_pos(pos);
  // The rotation's factors computed per row, then read from the step's table
  // (out_rope_table_cuda's (cos, -sin), as the engine passes it): both the CPU's bits.
  DeviceArray<float> d_table(size_t(T) * kRopeDim);
  cuda::out_rope_table_cuda(d_pos.get(), T, rope, d_table.get(), nullptr);
  for (const bool table : {false, true}) {
    d_q.upload(q);
    cuda::QHeadNormRopeParams p;
    p.num_tokens = T;
    p.num_heads = H;
    p.q = d_q.get();
    p.q_ld = ld;
    p.eps = kEps;
    p.positions = d_pos.get();
    p.rope = &rope;
    p.rope_table = table ? d_table.get() : nullptr;
    cuda::q_head_norm_rope_cuda(p, nullptr);
    sync_and_check("q_head_norm_rope");
    const std::vector<uint16_t> got = d_q.download();
    const int64_t c = first_diff(want, got);
    EXPECT_EQ(c, -1) << (table ? "table" : "computed") << " q: first difference at token " << c / ld << " head "
                     << (c % ld) / 512 << " dim " << (c % ld) % 512 << ": want "
                     << hex(want[size_t(std::max<int64_t>(c, 0))]) << " got " << hex(got[size_t(std::max<int64_t>(c, 0))]);
    EXPECT_EQ(d_q.guard_damage(), -1) << "write past q";
  }
  EXPECT_EQ(d_table.guard_damage(), -1) << "write past the table";
  std::printf("    q head: T %d H %d, %d position redraws, factors computed and from the table\n", T, H, redraws);
}

class QHeadNormRope : public DeviceTest {};

TEST_F(QHeadNormRope, FlashOneToken) { run_q_head({1, 64, 0, false, 21}); }
TEST_F(QHeadNormRope, FlashDecodeBatchSwaRope) { run_q_head({8, 64, 0, true, 22}); }
TEST_F(QHeadNormRope, ProHeadsWithRowPadding) { run_q_head({7, 128, 64, false, 23}); }
TEST_F(QHeadNormRope, FlashPrefillChunk) { run_q_head({200, 64, 0, false, 24}); }
// 3 heads: a CTA's 32 rows span 11 tokens; 37 tokens leave a partial last CTA.
TEST_F(QHeadNormRope, OddHeadCount) { run_q_head({37, 3, 8, false, 25}); }
TEST_F(QHeadNormRope, OneHead) { run_q_head({70, 1, 0, true, 26}); }

TEST_F(QHeadNormRope, RejectsAMisalignedTable) {
  const Rope rope = compressed_rope();
  DeviceArray<uint16_t> d_q(size_t(64) * 512);
  DeviceArray<int32_t> d_pos(std::vector<int32_t>{5});
  DeviceArray<float> d_table(kRopeDim + 2);
  cuda::QHeadNormRopeParams p;
  p.num_tokens = 1;
  p.num_heads = 64;
  p.q = d_q.get();
  p.q_ld = 64 * 512;
  p.positions = d_pos.get();
  p.rope = &rope;
  p.rope_table = d_table.get() + 2;  // 8 bytes past a 16-byte boundary
  EXPECT_THROW(cuda::q_head_norm_rope_cuda(p, nullptr), Error);
}

TEST_F(QHeadNormRope, ZeroTokensLaunchNothing) {
  const Rope rope = compressed_rope();
  cuda::QHeadNormRopeParams p;
  p.num_tokens = 0;
  p.num_heads = 64;
  p.rope = &rope;
  cuda::q_head_norm_rope_cuda(p, nullptr);
  sync_and_check("q_head_norm_rope, T = 0");
}

// ---- the output inverse RoPE --------------------------------------------------------------

void run_out_rope(int T, int H, int ld_pad, uint64_t seed) {
  std::mt19937_64 rng(seed);
  const Rope rope = compressed_rope();
  const int64_t ld = int64_t(H) * 512 + ld_pad;
  const std::vector<uint16_t> o = random_bf16_bits(rng, size_t(T) * size_t(ld), -8, 2);
  int redraws = 0;
  std::vector<int32_t> pos(static_cast<size_t>(T));
  for (int t = 0; t < T; ++t) pos[size_t(t)] = draw_position(rng, 1, 1048575, rope, redraws);
  if (T > 1) pos[1] = safe_position_at_most(1048575, rope, redraws);
  std::vector<uint16_t> want = o;
  for (int t = 0; t < T; ++t) {
    for (int h = 0; h < H; ++h) {
      uint16_t* tail = want.data() + size_t(t) * size_t(ld) + size_t(h) * 512 + kNopeDim;
      std::vector<float> x = bf16_to_floats(tail, kRopeDim);
      rope.apply(x.data(), pos[size_t(t)], /*inverse=*/true);
      for (int i = 0; i < kRopeDim; ++i) tail[i] = bf16_bits(x[size_t(i)]);
    }
  }
  DeviceArray<uint16_t> d_o(o);
  DeviceArray<int32_t> d_pos(pos);
  cuda::OutInverseRopeParams p;
  p.num_tokens = T;
  p.num_heads = H;
  p.o = d_o.get();
  p.o_ld = ld;
  p.positions = d_pos.get();
  p.rope = &rope;
  cuda::out_inverse_rope_cuda(p, nullptr);
  sync_and_check("out_inverse_rope");
  const std::vector<uint16_t> got = d_o.download();
  const int64_t c = first_diff(want, got);
  EXPECT_EQ(c, -1) << "o: first difference at token " << c / ld << " head " << (c % ld) / 512 << " dim "
                   << (c % ld) % 512 << ": want " << hex(want[size_t(std::max<int64_t>(c, 0))]) << " got "
                   << hex(got[size_t(std::max<int64_t>(c, 0))]);
  EXPECT_EQ(d_o.guard_damage(), -1) << "write past o";
  std::printf("    out rope: T %d H %d, %d position redraws\n", T, H, redraws);
}

class OutInverseRope : public DeviceTest {};

TEST_F(OutInverseRope, FlashOneToken) { run_out_rope(1, 64, 0, 31); }
TEST_F(OutInverseRope, FlashDecodeBatch) { run_out_rope(8, 64, 0, 32); }
TEST_F(OutInverseRope, ProHeadsWithRowPadding) { run_out_rope(9, 128, 16, 33); }
TEST_F(OutInverseRope, PrefillChunkOddHeads) { run_out_rope(150, 5, 8, 34); }

TEST_F(OutInverseRope, ZeroTokensLaunchNothing) {
  const Rope rope = compressed_rope();
  cuda::OutInverseRopeParams p;
  p.num_heads = 64;
  p.rope = &rope;
  cuda::out_inverse_rope_cuda(p, nullptr);
  sync_and_check("out_inverse_rope, T = 0");
}

// ---- residual + norm ------------------------------------------------------------------------

struct ResidualSpec {
  cuda::ResidualMode mode = cuda::ResidualMode::kAddNorm;
  int tokens = 4;
  int real = -1;  // rows that are not padding (-1: no device count)
  int dim = 4096;
  bool with_y = true;
  bool write_x = true;
  bool write_fp8 = true;
  uint64_t seed = 1;
};

void run_residual(const ResidualSpec& s) {
  std::mt19937_64 rng(s.seed);
  const int T = s.tokens, D = s.dim;
  const int real = s.real < 0 ? T : s.real;
  const bool norm = s.mode == cuda::ResidualMode::kAddNorm;
  const int64_t h_ld = D + 4, y_ld = D + 8, in_ld = D + 12, x_ld = D + 4;
  // Rows of different magnitudes, full fp32 mantissas.
  std::vector<float> h = random_normal(rng, size_t(T) * size_t(h_ld), 0.0f, 1.0f);
  std::vector<float> input = random_normal(rng, size_t(T) * size_t(in_ld), 0.0f, 1.0f);
  for (int t = 0; t < T; ++t) {
    const float scale = std::ldexp(1.0f, int(rng() % 12) - 6);
    for (int64_t i = 0; i < h_ld; ++i) h[size_t(t * h_ld + i)] *= scale;
    for (int64_t i = 0; i < in_ld; ++i) input[size_t(t * in_ld + i)] *= scale;
  }
  const std::vector<uint16_t> y = random_bf16_bits(rng, size_t(T) * size_t(y_ld), -7, 1);

  // The CPU twin.
  std::vector<float> h_want = h;
  std::vector<uint16_t> x_want(size_t(T) * size_t(x_ld), kPoisonBf16);
  Fp8Image fp8_want(T + 2, D, 4);
  std::vector<bool> risk(static_cast<size_t>(T));
  std::vector<float> x(static_cast<size_t>(D));
  for (int t = 0; t < T; ++t) {
    if (t >= real) {
      std::fill(x.begin(), x.end(), 0.0f);
    } else if (norm) {
      float* hr = h_want.data() + size_t(t) * size_t(h_ld);
      if (s.with_y)
        for (int i = 0; i < D; ++i) hr[i] += bf16_to_float(y[size_t(t) * size_t(y_ld) + size_t(i)]);
      risk[size_t(t)] = rms_tie_risk(hr, D);
      rms_norm(hr, nullptr, D, kEps, x.data());
      round_bf16(x.data(), size_t(D));
    } else {
      for (int i = 0; i < D; ++i) x[size_t(i)] = round_bf16(input[size_t(t) * size_t(in_ld) + size_t(i)]);
    }
    if (s.write_x)
      for (int i = 0; i < D; ++i) x_want[size_t(t) * size_t(x_ld) + size_t(i)] = bf16_bits(x[size_t(i)]);
    if (s.write_fp8) fp8_want.set_row(t, x.data());
  }

  // The GPU.
  DeviceArray<float> d_h(h), d_in(input);
  DeviceArray<uint16_t> d_y(y), d_x(x_want.size());
  d_x.fill_bytes(0xff);
  DeviceArray<int> d_real(std::vector<int>{real});
  Fp8Image fp8_got(T + 2, D, 4);
  Fp8Device d_fp8(fp8_got);
  cuda::ResidualNormParams p;
  p.mode = s.mode;
  p.num_tokens = T;
  p.num_real_tokens = s.real < 0 ? nullptr : d_real.get();
  p.dim = D;
  p.h = d_h.get();
  p.h_ld = h_ld;
  p.y = s.with_y ? d_y.get() : nullptr;
  p.y_ld = y_ld;
  p.input = d_in.get();
  p.input_ld = in_ld;
  p.eps = kEps;
  p.x = s.write_x ? d_x.get() : nullptr;
  p.x_ld = x_ld;
  if (s.write_fp8) p.x_fp8 = d_fp8.out(fp8_got);
  cuda::residual_norm_cuda(p, nullptr);
  sync_and_check("residual_norm");

  const std::vector<float> h_got = d_h.download();
  std::vector<uint16_t> x_got = d_x.download();
  d_fp8.download(fp8_got);
  int risky = 0;
  for (int t = 0; t < T; ++t) {
    if (!risk[size_t(t)]) continue;
    ++risky;
    for (int i = 0; i < D && s.write_x; ++i) {
      const size_t k = size_t(t) * size_t(x_ld) + size_t(i);
      ASSERT_TRUE(within_bf16_step(bf16_to_float(x_want[k]), bf16_to_float(x_got[k]))) << "risky row " << t;
      x_want[k] = x_got[k];
    }
    if (s.write_fp8) fp8_want.copy_row(t, fp8_got);
  }
  std::printf("    residual: T %d (real %d) D %d, %d rows with a norm tie risk\n", T, real, D, risky);
  const int64_t hd = first_diff(h_want, h_got);
  EXPECT_EQ(hd, -1) << "h: first difference at row " << hd / h_ld << " col " << hd % h_ld << ": want "
                    << h_want[size_t(std::max<int64_t>(hd, 0))] << " got " << h_got[size_t(std::max<int64_t>(hd, 0))];
  const int64_t xd = first_diff(x_want, x_got);
  EXPECT_EQ(xd, -1) << "x: first difference at row " << xd / x_ld << " col " << xd % x_ld << ": want "
                    << hex(x_want[size_t(std::max<int64_t>(xd, 0))]) << " got "
                    << hex(x_got[size_t(std::max<int64_t>(xd, 0))]);
  expect_fp8_equal(fp8_want, fp8_got, "x_fp8");
  EXPECT_EQ(d_h.guard_damage(), -1) << "write past h";
  EXPECT_EQ(d_x.guard_damage(), -1) << "write past x";
  EXPECT_EQ(d_fp8.codes.guard_damage(), -1) << "write past the FP8 codes";
  EXPECT_EQ(d_fp8.scales.guard_damage(), -1) << "write past the FP8 scales";
}

class ResidualNorm : public DeviceTest {};

constexpr auto kAdd = cuda::ResidualMode::kAddNorm;
constexpr auto kLoad = cuda::ResidualMode::kLoad;
// {mode, tokens, real tokens (-1: no device count), dim, y, x, x_fp8, seed}
TEST_F(ResidualNorm, AddNormPaddedDecodeBatch) { run_residual({kAdd, 9, 6, 4096, true, true, true, 41}); }
TEST_F(ResidualNorm, NormOnlyProWidth) { run_residual({kAdd, 3, -1, 7168, false, true, true, 42}); }
TEST_F(ResidualNorm, AddNormPrefillChunk) { run_residual({kAdd, 257, 257, 4096, true, true, true, 43}); }
TEST_F(ResidualNorm, AddNormWidestFp8Only) { run_residual({kAdd, 2, -1, 16384, true, false, true, 44}); }
TEST_F(ResidualNorm, AddNormNarrowBf16Only) { run_residual({kAdd, 33, 30, 128, true, true, false, 45}); }
TEST_F(ResidualNorm, Load) { run_residual({kLoad, 5, 5, 4096, false, true, true, 46}); }
TEST_F(ResidualNorm, LoadAllPadding) { run_residual({kLoad, 4, 0, 256, false, true, true, 47}); }
TEST_F(ResidualNorm, AddNormAllPaddingLeavesH) { run_residual({kAdd, 4, 0, 1024, true, true, true, 48}); }

TEST_F(ResidualNorm, ZeroTokensLaunchNothing) {
  cuda::ResidualNormParams p;
  p.dim = 4096;
  cuda::residual_norm_cuda(p, nullptr);
  sync_and_check("residual_norm, T = 0");
}

// ---- bf16 rounding (warp.cuh) ---------------------------------------------------------------

// warp.cuh rounds with the hardware's cvt.rn.bf16x2.f32 and promises
// dsv4::bf16_bits's bits for every float but NaN (a NaN stays a NaN). Every
// one of the 2^32 floats, as bf16_store, bf16_round and both halves of
// bf16x2_pack, against bf16_bits compiled for the device: mismatches counted,
// the smallest failing pattern kept. Patterns are numbered in a 64-bit
// loop so the last one (0xffffffff) is reached.
__global__ void bf16_rounding_sweep(unsigned long long* bad, unsigned* first) {
  const uint64_t stride = uint64_t(gridDim.x) * blockDim.x;
  for (uint64_t i = uint64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < (uint64_t(1) << 32); i += stride) {
    const uint32_t u = uint32_t(i), v = u ^ 0x80400001u;  // a second float for pack's other half
    const float f = __uint_as_float(u), g = __uint_as_float(v);
    const uint32_t want = dsv4::bf16_bits(f), want_g = dsv4::bf16_bits(g);
    const uint32_t got = cuda::bf16_store(f), rounded = __float_as_uint(cuda::bf16_round(f));
    const uint32_t lo = cuda::bf16x2_pack(f, g), hi = cuda::bf16x2_pack(g, f);
    const auto nan16 = [](uint32_t b) { return (b & 0x7fffu) > 0x7f80u; };
    bool ok;
    if ((u & 0x7fffffffu) > 0x7f800000u)
      ok = nan16(got) && (rounded & 0xffffu) == 0 && nan16(rounded >> 16) && nan16(lo) && nan16(hi >> 16);
    else
      ok = got == want && rounded == want << 16 && (lo & 0xffffu) == want && hi >> 16 == want;
    const bool g_nan = (v & 0x7fffffffu) > 0x7f800000u;
    ok = ok && (g_nan ? nan16(lo >> 16) && nan16(hi) : lo >> 16 == want_g && (hi & 0xffffu) == want_g);
    if (!ok) {
      atomicAdd(bad, 1ull);
      atomicMin(first, u);
    }
  }
}

// A sample of patterns (every 4099th, the bf16 ties and their neighbours
// near 1, the subnormal edge and the largest finite floats) rounded on the
// device by bf16_store, compared on the host with the CPU's own bf16_bits.
__global__ void bf16_store_each(const uint32_t* in, uint16_t* out, int n) {
  const int i = int(blockIdx.x * blockDim.x + threadIdx.x);
  if (i < n) out[i] = cuda::bf16_store(__uint_as_float(in[i]));
}

// act_quant.cuh's e4m3x2_codes (cvt.rn.satfinite.e4m3x2.f32) against
// float_to_e4m3 compiled for the device, both halves, every one of the 2^32
// floats: the same code for every float but NaN, a NaN code (0x7f or 0xff)
// for NaN.
__global__ void e4m3_codes_sweep(unsigned long long* bad, unsigned* first) {
  const uint64_t stride = uint64_t(gridDim.x) * blockDim.x;
  for (uint64_t i = uint64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < (uint64_t(1) << 32); i += stride) {
    const uint32_t u = uint32_t(i), v = u ^ 0x80400001u;
    const float f = __uint_as_float(u), g = __uint_as_float(v);
    const uint32_t got = cuda::e4m3x2_codes(f, g), swapped = cuda::e4m3x2_codes(g, f);
    const auto same = [](float x, uint32_t code) {
      return (__float_as_uint(x) & 0x7fffffffu) > 0x7f800000u ? (code & 0x7fu) == 0x7fu
                                                             : code == dsv4::float_to_e4m3(x);
    };
    if (!(same(f, got & 0xffu) && same(g, got >> 8) && same(g, swapped & 0xffu) && same(f, swapped >> 8))) {
      atomicAdd(bad, 1ull);
      atomicMin(first, u);
    }
  }
}

// A sample of patterns (every 4099th, the e4m3 ties and their neighbours near
// 1 and 448, the subnormal edge 2^-6 .. 2^-9) converted on the device by
// e4m3x2_codes, compared on the host with the CPU's own float_to_e4m3.
__global__ void e4m3_codes_each(const uint32_t* in, uint8_t* out, int n) {
  const int i = int(blockIdx.x * blockDim.x + threadIdx.x);
  if (i < n) out[i] = uint8_t(cuda::e4m3x2_codes(__uint_as_float(in[i]), 0.0f));
}

class Bf16Rounding : public DeviceTest {};
class E4m3Codes : public DeviceTest {};

// Runs a sweep kernel over the 2^32 floats (it counts the mismatches and keeps
// the smallest failing pattern) and expects none.
void expect_clean_sweep(void (*sweep)(unsigned long long*, unsigned*), const char* what) {
  DeviceArray<unsigned long long> count(std::vector<unsigned long long>{0});
  DeviceArray<unsigned> first(std::vector<unsigned>{0xffffffffu});
  sweep<<<1024, 256>>>(count.get(), first.get());
  sync_and_check(what);
  EXPECT_EQ(count.download()[0], 0u) << what << ": first failing float bits 0x" << std::hex << first.download()[0];
}

// Every 4099th float, then base + (b << shift) + low for each base, b < 4096
// and low (a rounding boundary's neighbours).
std::vector<uint32_t> sample_floats(std::initializer_list<uint32_t> bases, int shift,
                                    std::initializer_list<uint32_t> lows) {
  std::vector<uint32_t> in;
  for (uint64_t u = 0; u < (uint64_t(1) << 32); u += 4099) in.push_back(uint32_t(u));
  for (uint32_t b = 0; b < 4096; ++b)
    for (uint32_t base : bases)
      for (uint32_t low : lows) in.push_back(base + (b << shift) + low);
  return in;
}

// The sampled half of a conversion test: each float of `in` through `each` on
// the device (one result per input), compared on the host with the CPU's
// want(f) for every non-NaN input; a NaN input's result must satisfy nan_ok.
template <typename Out, typename Want, typename NanOk>
void expect_cpu_results(void (*each)(const uint32_t*, Out*, int), const std::vector<uint32_t>& in, Want want,
                        NanOk nan_ok, const char* what) {
  const DeviceArray<uint32_t> din(in);
  DeviceArray<Out> dout(in.size());
  const int n = int(in.size());
  each<<<(n + 255) / 256, 256>>>(din.get(), dout.get(), n);
  sync_and_check(what);
  const std::vector<Out> out = dout.download();
  int checked = 0;
  for (size_t i = 0; i < in.size(); ++i) {
    const float f = std::bit_cast<float>(in[i]);
    if (std::isnan(f)) {
      ASSERT_TRUE(nan_ok(out[i])) << what << ": float bits 0x" << std::hex << in[i];
      continue;
    }
    ASSERT_EQ(out[i], want(f)) << what << ": float bits 0x" << std::hex << in[i];
    ++checked;
  }
  EXPECT_GT(checked, 1000000) << what;
}

TEST_F(Bf16Rounding, HardwareConversionGivesTheCpuBitsForEveryFloatButNaN) {
  expect_clean_sweep(bf16_rounding_sweep, "bf16 rounding sweep");
  // Around 1.0 and 2^-126 and below the largest floats: ties, odd and even.
  expect_cpu_results(
      bf16_store_each,
      sample_floats({0x3f800000u, 0x00800000u, 0x00000000u, 0x7f7f0000u}, 16, {0x7fffu, 0x8000u, 0x8001u}),
      [](float f) { return bf16_bits(f); }, [](uint16_t b) { return std::isnan(bf16_to_float(b)); },
      "bf16_store sample");
}

TEST_F(E4m3Codes, HardwareConversionGivesTheCpuCodesForEveryFloatButNaN) {
  expect_clean_sweep(e4m3_codes_sweep, "e4m3 conversion sweep");
  // The e4m3 rounding bit is bit 19: ties near 1, 2^-6 (the normal edge),
  // 2^-9 (the smallest subnormal) and 448 (saturation), odd and even.
  expect_cpu_results(e4m3_codes_each,
                     sample_floats({0x3f800000u, 0x3c800000u, 0x3b000000u, 0x43e00000u, 0xc3e00000u}, 20,
                                   {0x7ffffu, 0x80000u, 0x80001u}),
                     [](float f) { return float_to_e4m3(f); }, [](uint8_t c) { return (c & 0x7f) == 0x7f; },
                     "e4m3x2_codes sample");
}

// ---- host-side checks (no device needed) -------------------------------------------------

TEST(FusedChecks, BadParamsThrowBeforeLaunching) {
  const Rope rope = compressed_rope();
  alignas(16) static uint8_t buf[1 << 16];
  const int32_t pos[1] = {0};
  const int32_t slot[1] = {0};
  const float w[4096] = {};
  cuda::QkvNormRopeParams q;
  q.num_tokens = 1;
  q.q_lora = 1024;
  q.qkv = reinterpret_cast<const uint16_t*>(buf);
  q.qkv_ld = 1536;
  q.q_norm = w;
  q.kv_norm = w;
  q.positions = pos;
  q.rope = &rope;
  q.swa = KvPagesMut{buf, 1, 64, fp8_ds_mla_page_stride(64)};
  q.swa_slot = slot;
  EXPECT_NO_THROW(cuda::check_qkv_norm_rope_params(q));
  auto bad = q;
  bad.q_lora = 1000;
  EXPECT_THROW(cuda::check_qkv_norm_rope_params(bad), Error);
  bad = q;
  bad.q_lora = 3712;  // 29 + 4 warps
  EXPECT_THROW(cuda::check_qkv_norm_rope_params(bad), Error);
  bad = q;
  bad.qkv_ld = 1500;
  EXPECT_THROW(cuda::check_qkv_norm_rope_params(bad), Error);
  bad = q;
  bad.rope = nullptr;
  EXPECT_THROW(cuda::check_qkv_norm_rope_params(bad), Error);
  bad = q;
  bad.swa.page_stride = 584 * 64;  // not rounded up to a multiple of 576
  EXPECT_THROW(cuda::check_qkv_norm_rope_params(bad), Error);
  bad = q;
  bad.cq_fp8 = Fp8ActOut{buf, reinterpret_cast<float*>(buf), 1, 512, 1024, 1};  // wrong width
  EXPECT_THROW(cuda::check_qkv_norm_rope_params(bad), Error);
  bad = q;
  bad.tokens_per_cta = 3;
  EXPECT_THROW(cuda::check_qkv_norm_rope_params(bad), Error);
  bad.tokens_per_cta = 16;
  EXPECT_THROW(cuda::check_qkv_norm_rope_params(bad), Error);

  cuda::QHeadNormRopeParams h;
  h.num_tokens = 1;
  h.num_heads = 64;
  h.q = reinterpret_cast<uint16_t*>(buf);
  h.q_ld = 64 * 512;
  h.positions = pos;
  h.rope = &rope;
  EXPECT_NO_THROW(cuda::check_q_head_norm_rope_params(h));
  h.q_ld = 64 * 512 + 4;  // rows not 16-byte aligned
  EXPECT_THROW(cuda::check_q_head_norm_rope_params(h), Error);
  h.q_ld = 64 * 512;
  h.num_tokens = 1 << 25;  // 2^31 (token, head) rows: past the kernel's int row numbers
  EXPECT_THROW(cuda::check_q_head_norm_rope_params(h), Error);

  cuda::OutInverseRopeParams o;
  o.num_tokens = 1;
  o.num_heads = 64;
  o.o = reinterpret_cast<uint16_t*>(buf + 2);  // misaligned
  o.o_ld = 64 * 512;
  o.positions = pos;
  o.rope = &rope;
  EXPECT_THROW(cuda::check_out_inverse_rope_params(o), Error);

  cuda::ResidualNormParams r;
  r.num_tokens = 1;
  r.dim = 4096;
  r.h = reinterpret_cast<float*>(buf);
  r.h_ld = 4096;
  r.x = reinterpret_cast<uint16_t*>(buf);
  r.x_ld = 4096;
  EXPECT_NO_THROW(cuda::check_residual_norm_params(r));
  r.dim = 4000;
  EXPECT_THROW(cuda::check_residual_norm_params(r), Error);
  r.dim = 4096 * 5;  // past 16384
  EXPECT_THROW(cuda::check_residual_norm_params(r), Error);
  r.dim = 4096;
  r.x = nullptr;  // nothing written
  EXPECT_THROW(cuda::check_residual_norm_params(r), Error);
}

}  // namespace
}  // namespace dsv4::test::fused
