// The compressor on the GPU (compressor_cuda) against its CPU twin
// (compress_cpu) on the same random steps: state rows and records compared
// bit for bit over the whole state and output caches (so -1 slots, slots past
// a capacity and every byte around the written records are checked), for
// m = 4 and 128, c = 512 and 128, fp8_ds_mla and both indexer key formats,
// chunks that end inside a compression window (rows of an earlier step in the
// state cache), prompts shorter than one block, C4A slot 0, positions at the
// end of the 1M context, caches past 2 GiB and, for C128A's decode cluster
// kernel, maxima that tie +0 and -0 and a block end without state pages; each
// step also as a kRuns step (one kernel pooling the step's rows from the
// projection) under the launcher's rule (at m = 4 in a short step 4 tokens a
// CTA), on the quad kernel at m = 4 (groups of 4 tokens, which runs of 3, 4,
// 37, 4 and 1 tokens cross) and with spans of 1, 3, 7 and the most tokens a
// CTA, asserting which launch ran; and steps whose state blocks have pages
// only where a later token reads them, as the block manager gives them (the
// records the same bits as with every block mapped).
// compress_cpu itself is checked
// against the direct formula of SPEC §4.3 in double precision, and the shared
// exp_f32 for accuracy and host/device identity. Device tests skip without a
// CUDA device.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <map>
#include <random>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "attn/compressor_math.h"
#include "attn/compressor_params.h"
#include "attn/cpu/compress_cpu.h"
#include "attn/cuda/compressor_cuda.h"
#include "cache/fp8_ds_mla.h"
#include "cache/index_key_format.h"
#include "common/error.h"
#include "fused_support.cuh"
#include "numerics/bf16.h"
#include "numerics/rmsnorm.h"
#include "numerics/rope.h"

namespace dsv4::test::fused {
namespace {

constexpr float kEps = 1e-6f;

// ---- a random step of one compressor --------------------------------------------------

struct RunSpec {
  int64_t start = 0;
  int len = 1;
};

struct CompSpec {
  int m = 4;
  int c = 512;
  EntryFormat record = EntryFormat::kFp8DsMla;
  bool hadamard = false;
  std::vector<RunSpec> runs;
  bool big = false;  // state and output caches past 2 GiB, the used pages at their top
  uint64_t seed = 1;
  cuda::CompressorLaunch launch = cuda::CompressorLaunch::kAny;
  // Every gate of the earlier rows -(|N| + 1), or +0 or -0 (an eighth each),
  // the tokens' own gates far below: each channel's maximum a tie of zeros.
  bool zero_tie_gates = false;
  // A run whose state pages are all unmapped (its table -1, so its row slots
  // are negative too) while its entries have slots: nothing of the state may
  // be read or written for it; its entries pool the rows of this step alone.
  int unmapped_run = -1;
  // The state blocks as the block manager gives them pages: none for a block
  // that a run's own tokens fill and no later token reads (the rows are
  // pooled from the projection; CacheSpec::needs_page).
  bool live_state_only = false;
  int kernels = 0;  // > 0: the launches compressor_kernels must report
  int span = 0;     // set_compressor_span_tokens during the call
  int quad_from = -1;  // set_compressor_quad_from during the call (0: quad_kernel at m = 4)
  bool clusters = true;
};

int state_entries_per_page(int m) { return m == 4 ? 4 : 128; }  // the state groups' pages
int out_entries_per_page(const CompSpec& s) { return s.record == EntryFormat::kFp8DsMla && s.m == 128 ? 2 : 64; }

// Everything a call reads, on the host, plus the rows by (run, position)
// for the direct formula.
struct CompCase {
  CompSpec spec;
  int T = 0, kc = 0, row_floats = 0, Bs = 0, Bo = 0;
  size_t s_stride = 0, o_stride = 0;
  int64_t s_pages = 0, o_pages = 0;
  int64_t proj_ld = 0;
  int a_col = 8;
  std::vector<float> proj, ape, norm;
  std::vector<int32_t> positions;
  std::vector<int32_t> token_run, row_slot, entry_slot;
  int width = 0;
  std::vector<int32_t> table_pages, table_first;
  std::vector<uint8_t> state, out;  // the caches before the call
  std::map<std::pair<int, int64_t>, std::vector<float>> rows;  // (run, position) -> [a | g + ape]
  Rope rope = compressed_rope();
  int rope_redraws = 0;

  int64_t s_cap() const { return s_pages * Bs; }
  int64_t o_cap() const { return o_pages * Bo; }
  int32_t state_slot(int r, int64_t pos) const {
    const int64_t col = pos / Bs - table_first[size_t(r)];
    const int32_t page = table_pages[size_t(r) * size_t(width) + size_t(col)];
    return page < 0 ? -1 : int32_t(int64_t(page) * Bs + pos % Bs);
  }

  // Params on the given buffers (host or device).
  CompressorParams params(const float* proj_p, const float* ape_p, const float* norm_p, const int32_t* pos_p,
                          const int32_t* run_p, const int32_t* row_p, const int32_t* entry_p, const int32_t* pages_p,
                          const int32_t* first_p, uint8_t* state_p, uint8_t* out_p) const {
    CompressorParams p;
    p.num_tokens = T;
    p.ratio = spec.m;
    p.dim = spec.c;
    p.proj = proj_p;
    p.proj_ld = proj_ld;
    p.a_col = a_col;
    p.ape = ape_p;
    p.norm = norm_p;
    p.eps = kEps;
    p.rope = &rope;
    p.positions = pos_p;
    p.token_run = run_p;
    p.row_slot = row_p;
    p.entry_slot = entry_p;
    p.state_table = BlockTableView{pages_p, first_p, width, Bs};
    p.state = KvPagesMut{state_p, s_pages, Bs, s_stride};
    p.out = KvPagesMut{out_p, o_pages, Bo, o_stride};
    p.record = spec.record;
    p.bf16_rounding = true;
    p.hadamard = spec.hadamard;
    return p;
  }
};

// Distinct random pages from [lo, hi).
class PageDraw {
 public:
  PageDraw(std::mt19937_64& rng, int64_t lo, int64_t hi) : rng_(rng), lo_(lo), hi_(hi) {}
  int32_t next() {
    if (int64_t(used_.size()) >= hi_ - lo_) throw std::runtime_error("test setup: out of pages");
    int32_t p;
    do p = int32_t(lo_ + int64_t(rng_() % uint64_t(hi_ - lo_)));
    while (!used_.insert(p).second);
    return p;
  }

 private:
  std::mt19937_64& rng_;
  int64_t lo_, hi_;
  std::set<int32_t> used_;
};

CompCase make_case(const CompSpec& s) {
  std::mt19937_64 rng(s.seed);
  CompCase k;
  k.spec = s;
  const int m = s.m, c = s.c;
  k.kc = (m == 4 ? 2 : 1) * c;
  k.row_floats = 2 * k.kc;
  k.Bs = state_entries_per_page(m);
  k.Bo = out_entries_per_page(s);
  k.s_stride = sizeof(float) * size_t(k.row_floats) * size_t(k.Bs);
  k.o_stride = entry_page_stride(s.record, k.Bo, c);
  const int lookback = m == 4 ? 8 : 128;  // rows of earlier steps a run's entries can pool

  // Page counts: what the runs need, plus spares; `big` puts them past 2^31 bytes.
  int64_t s_need = 0, o_need = 0;
  for (const RunSpec& r : s.runs) {
    const int64_t lo = std::max<int64_t>(0, r.start - lookback), hi = r.start + r.len - 1;
    s_need += hi / k.Bs - lo / k.Bs + 1;
    o_need += r.len / m / k.Bo + 2;  // blocks of the run's entries
  }
  const int64_t s_low = s.big ? int64_t((size_t(1) << 31) / k.s_stride) + 1 : 0;
  const int64_t o_low = s.big ? int64_t((size_t(1) << 31) / k.o_stride) + 1 : 0;
  k.s_pages = s_low + s_need + 6;
  k.o_pages = o_low + o_need + 3;
  PageDraw s_draw(rng, s_low, k.s_pages), o_draw(rng, o_low, k.o_pages);

  k.state.resize(k.s_stride * size_t(k.s_pages));
  k.out.resize(k.o_stride * size_t(k.o_pages));
  if (s.big) {
    std::fill(k.state.begin(), k.state.end(), uint8_t(0xa5));
    std::fill(k.out.begin(), k.out.end(), uint8_t(0xa5));
  } else {
    for (auto& b : k.state) b = uint8_t(rng());
    for (auto& b : k.out) b = uint8_t(rng());
  }

  // State tables: run r maps blocks first .. first + n - 1, one spare -1 column
  // (with live_state_only the dead blocks' pages are drawn, then unmapped, so
  // every other draw is the same as without).
  for (const RunSpec& r : s.runs) {
    const int64_t lo = std::max<int64_t>(0, r.start - lookback), hi = r.start + r.len - 1;
    k.width = std::max<int>(k.width, int(hi / k.Bs - lo / k.Bs + 2));
  }
  k.table_pages.assign(s.runs.size() * size_t(k.width), -1);
  for (size_t r = 0; r < s.runs.size(); ++r) {
    const int64_t lo = std::max<int64_t>(0, s.runs[r].start - lookback), hi = s.runs[r].start + s.runs[r].len - 1;
    k.table_first.push_back(int32_t(lo / k.Bs));
    const int64_t start = s.runs[r].start, end = start + s.runs[r].len;
    const int64_t live = m == 4 ? std::max<int64_t>(0, end / 4 - 1) : end / 128;  // first_live_block
    for (int64_t b = lo / k.Bs; b <= hi / k.Bs && int(r) != s.unmapped_run; ++b) {
      const int32_t page = s_draw.next();
      const bool dead = s.live_state_only && b * k.Bs >= start && b < live;
      k.table_pages[r * size_t(k.width) + size_t(b - lo / k.Bs)] = dead ? -1 : page;
    }
  }

  // Rows of earlier steps: positions lo .. start - 1 of each run.
  std::normal_distribution<float> nd(0.0f, 1.0f);
  for (size_t r = 0; r < s.runs.size(); ++r) {
    if (int(r) == s.unmapped_run) continue;
    for (int64_t p = std::max<int64_t>(0, s.runs[r].start - lookback); p < s.runs[r].start; ++p) {
      std::vector<float> row(size_t(k.row_floats));
      for (int i = 0; i < k.row_floats; ++i) row[size_t(i)] = i < k.kc ? nd(rng) : 2.0f * nd(rng);
      if (s.zero_tie_gates)
        for (int i = k.kc; i < k.row_floats; ++i) {
          const uint64_t pick = rng() % 8;
          row[size_t(i)] = pick == 0 ? 0.0f : pick == 1 ? -0.0f : -(std::fabs(row[size_t(i)]) + 1.0f);
        }
      const int32_t slot = k.state_slot(int(r), p);
      uint8_t* page = k.state.data() + size_t(slot / k.Bs) * k.s_stride;
      std::memcpy(page + sizeof(float) * size_t(k.row_floats) * size_t(slot % k.Bs), row.data(), sizeof(float) * row.size());
      k.rows[{int(r), p}] = row;
    }
  }

  // Tokens: the runs in order, then two padding tokens (slots -1; slots past the capacities).
  k.proj_ld = k.a_col + 2 * k.kc + 12;
  k.ape = random_normal(rng, size_t(m) * size_t(k.kc), 0.0f, 0.5f);
  k.norm = random_norm_weight(rng, size_t(c));
  std::map<std::pair<size_t, int64_t>, int32_t> out_page;  // (run, block) -> page
  for (size_t r = 0; r < s.runs.size(); ++r) {
    for (int i = 0; i < s.runs[r].len; ++i) {
      const int64_t p = s.runs[r].start + i;
      k.positions.push_back(p);
      k.token_run.push_back(int32_t(r));
      k.row_slot.push_back(k.state_slot(int(r), p));  // -1 in an unmapped block
      int32_t e = -1;
      if ((p + 1) % m == 0) {
        const int64_t j = (p + 1) / m - 1;
        auto it = out_page.find({r, j / k.Bo});
        if (it == out_page.end()) it = out_page.emplace(std::make_pair(r, j / k.Bo), o_draw.next()).first;
        e = int32_t(int64_t(it->second) * k.Bo + j % k.Bo);
      }
      k.entry_slot.push_back(e);
    }
  }
  k.positions.push_back(5), k.token_run.push_back(0), k.row_slot.push_back(-1), k.entry_slot.push_back(-1);
  k.positions.push_back(2 * m - 1), k.token_run.push_back(0);
  k.row_slot.push_back(int32_t(k.s_cap())), k.entry_slot.push_back(int32_t(k.o_cap()));
  k.T = int(k.positions.size());
  const int real = k.T - 2;

  k.proj = random_normal(rng, size_t(k.T) * size_t(k.proj_ld), 0.0f, 1.0f);
  for (int t = 0; t < k.T; ++t) {
    float* x = k.proj.data() + size_t(t) * size_t(k.proj_ld);
    for (int i = 0; i < k.kc; ++i) x[k.a_col + k.kc + i] *= 2.0f;  // gates spread wider than values
    if (s.zero_tie_gates)
      for (int i = 0; i < k.kc; ++i) x[k.a_col + k.kc + i] = -40.0f;
    if (t >= real) continue;  // padding: its row is nobody's
    std::vector<float> row(size_t(k.row_floats));
    const float* ape = k.ape.data() + size_t(k.positions[size_t(t)] % m) * size_t(k.kc);
    for (int i = 0; i < k.kc; ++i) {
      row[size_t(i)] = x[k.a_col + i];
      row[size_t(k.kc + i)] = x[k.a_col + k.kc + i] + ape[i];
    }
    k.rows[{k.token_run[size_t(t)], k.positions[size_t(t)]}] = row;
  }
  return k;
}

// ---- records --------------------------------------------------------------------------

// Byte ranges (offset in the page, length) of entry t's record.
std::vector<std::pair<size_t, size_t>> record_ranges(EntryFormat r, int B, int t) {
  switch (r) {
    case EntryFormat::kFp8DsMla:
      return {{fp8_ds_mla_data_offset(t), kKvEntryDataBytes}, {fp8_ds_mla_scale_offset(B, t), kKvEntryScaleBytes}};
    case EntryFormat::kIndexFp8:
      return {{size_t(kIndexDim) * t, kIndexDim}, {size_t(kIndexDim) * B + 4 * size_t(t), 4}};
    case EntryFormat::kIndexMxfp4:
      return {{size_t(kIndexDim / 2) * t, kIndexDim / 2}, {size_t(kIndexDim / 2) * B + 4 * size_t(t), 4}};
    case EntryFormat::kF32: return {{sizeof(float) * kKvDim * size_t(t), sizeof(float) * kKvDim}};
  }
  return {};
}

std::vector<float> decode_record(EntryFormat r, const uint8_t* page, int B, int t) {
  std::vector<float> v(r == EntryFormat::kFp8DsMla ? kKvDim : kIndexDim);
  if (r == EntryFormat::kFp8DsMla) fp8_ds_mla_decode(page, B, t, v.data());
  if (r == EntryFormat::kIndexFp8) index_key_decode(IndexKeyFormat::kFp8, page, B, t, v.data());
  if (r == EntryFormat::kIndexMxfp4) index_key_decode(IndexKeyFormat::kMxfp4, page, B, t, v.data());
  return v;
}

// Where byte `off` of an output cache lies, in words.
std::string out_where(const CompCase& k, int64_t off) {
  const int64_t page = off / int64_t(k.o_stride), in = off % int64_t(k.o_stride);
  for (int t = 0; t < k.Bo; ++t)
    for (auto [o, n] : record_ranges(k.spec.record, k.Bo, t))
      if (in >= int64_t(o) && in < int64_t(o + n))
        return "byte " + std::to_string(off) + " (page " + std::to_string(page) + ", entry " + std::to_string(t) +
               ", byte " + std::to_string(in - int64_t(o)) + " of a " + std::to_string(n) + "-byte range)";
  return "byte " + std::to_string(off) + " (page " + std::to_string(page) + ", outside every record)";
}

std::string state_where(const CompCase& k, int64_t off) {
  const int64_t page = off / int64_t(k.s_stride), in = off % int64_t(k.s_stride);
  const int64_t row = in / (4 * k.row_floats), f = (in % (4 * k.row_floats)) / 4;
  return "byte " + std::to_string(off) + " (page " + std::to_string(page) + ", row " + std::to_string(row) +
         ", float " + std::to_string(f) + (f < k.kc ? ": a" : ": g + ape") + ")";
}

// ---- GPU against CPU --------------------------------------------------------------------

// The GPU's output cache goes to *records when asked for.
void run_compressor(const CompSpec& spec, std::vector<uint8_t>* records = nullptr) {
  const CompCase k = make_case(spec);
  const int m = spec.m, c = spec.c;

  // The CPU twin.
  std::vector<uint8_t> state_want = k.state, out_want = k.out;
  const CompressorParams hp =
      k.params(k.proj.data(), k.ape.data(), k.norm.data(), k.positions.data(), k.token_run.data(), k.row_slot.data(),
               k.entry_slot.data(), k.table_pages.data(), k.table_first.data(), state_want.data(), out_want.data());
  compress_cpu(hp);

  // The GPU.
  DeviceArray<float> d_proj(k.proj), d_ape(k.ape), d_norm(k.norm);
  DeviceArray<int32_t> d_pos(k.positions);
  DeviceArray<int32_t> d_run(k.token_run), d_row(k.row_slot), d_entry(k.entry_slot);
  DeviceArray<int32_t> d_pages(k.table_pages), d_first(k.table_first);
  DeviceBytes d_state(k.state.size()), d_out(k.out.size());
  if (spec.big) {
    d_state.fill(0xa5);
    d_out.fill(0xa5);
  }
  d_state.upload(k.state.data(), k.state.size());  // the earlier rows (and the pattern again when big)
  if (!spec.big) d_out.upload(k.out.data(), k.out.size());
  const CompressorParams dp = k.params(d_proj.get(), d_ape.get(), d_norm.get(), d_pos.get(), d_run.get(), d_row.get(),
                                       d_entry.get(), d_pages.get(), d_first.get(), d_state.get(), d_out.get());
  cuda::set_compressor_span_tokens(spec.span, spec.clusters);
  cuda::set_compressor_quad_from(spec.quad_from);
  const int kernels = cuda::compressor_kernels(dp, spec.launch);
  cuda::compressor_cuda(dp, nullptr, spec.launch);
  cuda::set_compressor_span_tokens(0);
  cuda::set_compressor_quad_from(-1);
  sync_and_check("compressor_cuda");
  if (spec.kernels > 0) ASSERT_EQ(kernels, spec.kernels) << "not the launch the test asks for";
  const std::vector<uint8_t> state_got = d_state.download(), out_got = d_out.download();

  // Entries where rounding may differ (fused_support.cuh): close, then taken as they are.
  int entries = 0, risky = 0;
  std::vector<float> v(static_cast<size_t>(c));
  for (int t = 0; t < k.T; ++t) {
    const int64_t slot = k.entry_slot[size_t(t)];
    if (slot < 0 || slot >= k.o_cap()) continue;
    ++entries;
    const int64_t j = (k.positions[size_t(t)] + 1) / m - 1;
    compress_pool_cpu(hp, t, v.data());  // this step's rows are in state_want now
    round_bf16(v.data(), v.size());
    if (!rms_tie_risk(v.data(), c) && !rope_tie_risk(j * m, k.rope)) continue;
    ++risky;
    const size_t page = size_t(slot / k.Bo) * k.o_stride;
    const int te = int(slot % k.Bo);
    const std::vector<float> a = decode_record(spec.record, out_want.data() + page, k.Bo, te);
    const std::vector<float> b = decode_record(spec.record, out_got.data() + page, k.Bo, te);
    float amax = 0;
    for (float x : a) amax = std::max(amax, std::fabs(x));
    for (size_t i = 0; i < a.size(); ++i)
      ASSERT_TRUE(std::isfinite(b[i]) && std::fabs(a[i] - b[i]) <= 0.34f * amax)
          << "risky entry of token " << t << " dim " << i << ": want " << a[i] << " got " << b[i];
    for (auto [o, n] : record_ranges(spec.record, k.Bo, te))
      std::memcpy(out_want.data() + page + o, out_got.data() + page + o, n);
  }
  std::printf("    compressor m %d c %d: %d tokens, %d entries (%d with a tie risk), caches %.1f + %.1f MB\n", m, c,
              k.T, entries, risky, k.state.size() / 1e6, k.out.size() / 1e6);
  ASSERT_GT(entries, 0) << "test setup: no entry completes";

  const int64_t s = first_diff(state_want.data(), state_got.data(), state_want.size());
  EXPECT_EQ(s, -1) << "state cache: first difference at " << state_where(k, s) << ": want "
                   << hex(state_want[size_t(std::max<int64_t>(s, 0))]) << " got "
                   << hex(state_got[size_t(std::max<int64_t>(s, 0))]);
  const int64_t o = first_diff(out_want.data(), out_got.data(), out_want.size());
  EXPECT_EQ(o, -1) << "output cache: first difference at " << out_where(k, o) << ": want "
                   << hex(out_want[size_t(std::max<int64_t>(o, 0))]) << " got "
                   << hex(out_got[size_t(std::max<int64_t>(o, 0))]);
  EXPECT_EQ(d_state.guard_damage(), -1) << "write past the state cache";
  EXPECT_EQ(d_out.guard_damage(), -1) << "write past the output cache";
  if (records) *records = out_got;
}

// Runs of a C4A step: a prompt shorter than one block; a prompt of exactly
// one block (slot 0: block -1 absent); a chunk from position 10 ending
// inside a window (its first entries pool rows 4..9 of an earlier step); the
// end of the 1M context (slot 262143 at position 1048575); a decode token
// that completes nothing.
std::vector<RunSpec> c4a_runs() { return {{0, 3}, {0, 4}, {10, 37}, {1048572, 4}, {1048573, 1}}; }

// C128A: a prompt shorter than one block; one whole block (slot 0); a chunk
// 200..349 (slot 1 at 255 pools rows 128..199 of an earlier step, then stops
// inside slot 2); a decode token at 1048575 (slot 8191: 127 earlier rows); a
// chunk that ends inside a block.
std::vector<RunSpec> c128a_runs() { return {{0, 100}, {0, 128}, {200, 150}, {1048575, 1}, {1048448, 64}}; }

class Compressor : public DeviceTest {};

TEST_F(Compressor, C4AMain) { run_compressor({4, 512, EntryFormat::kFp8DsMla, false, c4a_runs(), false, 51}); }
TEST_F(Compressor, C4AIndexerFp8Keys) {
  run_compressor({4, 128, EntryFormat::kIndexFp8, true, c4a_runs(), false, 52});
}
TEST_F(Compressor, C4AIndexerMxfp4Keys) {
  run_compressor({4, 128, EntryFormat::kIndexMxfp4, true, c4a_runs(), false, 53});
}
TEST_F(Compressor, C128AMain) {
  run_compressor({128, 512, EntryFormat::kFp8DsMla, false, c128a_runs(), false, 54});
}
TEST_F(Compressor, C4APrefillChunk) {
  run_compressor({4, 512, EntryFormat::kFp8DsMla, false, {{4096, 2048}, {37, 515}}, false, 55});
}
// Long enough that the entries kernel's CTAs (spans of tokens, about one
// wave of them) take several 128-dim entries each, across two runs.
TEST_F(Compressor, C4AIndexerLongChunk) {
  run_compressor({4, 128, EntryFormat::kIndexMxfp4, true, {{4096, 8200}, {37, 515}}, false, 59});
}
TEST_F(Compressor, C128APrefillChunk) {
  run_compressor({128, 512, EntryFormat::kFp8DsMla, false, {{0, 1000}, {4000, 700}}, false, 56});
}
// Both caches past 2^31 bytes, the written pages at their top.
TEST_F(Compressor, C4ACachesPast2GiB) {
  run_compressor({4, 512, EntryFormat::kFp8DsMla, false, {{10, 37}, {1048572, 4}}, true, 57});
}
TEST_F(Compressor, C128ACachesPast2GiB) {
  run_compressor({128, 512, EntryFormat::kFp8DsMla, false, {{200, 150}, {1048575, 1}}, true, 58});
}

// Decode steps (one token per run: rows and entries in one kernel). C4A:
// the first block end (block -1 absent), later block ends whose windows
// hold 7 rows of earlier steps, tokens that complete nothing, the last slot
// of the 1M context.
std::vector<RunSpec> c4a_decode_runs() { return {{3, 1}, {7, 1}, {11, 1}, {10, 1}, {0, 1}, {1048575, 1}, {1048573, 1}}; }
// C128A: the first block end, the second, the last slot, tokens that complete nothing.
std::vector<RunSpec> c128a_decode_runs() { return {{127, 1}, {255, 1}, {1048575, 1}, {200, 1}, {0, 1}}; }
constexpr cuda::CompressorLaunch kOneToken = cuda::CompressorLaunch::kOneTokenPerRun;

TEST_F(Compressor, C4AMainDecode) {
  run_compressor({4, 512, EntryFormat::kFp8DsMla, false, c4a_decode_runs(), false, 71, kOneToken});
}
TEST_F(Compressor, C4AIndexerFp8KeysDecode) {
  run_compressor({4, 128, EntryFormat::kIndexFp8, true, c4a_decode_runs(), false, 72, kOneToken});
}
TEST_F(Compressor, C4AIndexerMxfp4KeysDecode) {
  run_compressor({4, 128, EntryFormat::kIndexMxfp4, true, c4a_decode_runs(), false, 73, kOneToken});
}
TEST_F(Compressor, C128AMainDecode) {
  run_compressor({128, 512, EntryFormat::kFp8DsMla, false, c128a_decode_runs(), false, 74, kOneToken});
}
// The cluster kernel of C128A's main entries: both caches past 2^31 bytes.
TEST_F(Compressor, C128ADecodeCachesPast2GiB) {
  run_compressor({128, 512, EntryFormat::kFp8DsMla, false, {{255, 1}, {1048575, 1}, {300, 1}}, true, 76, kOneToken});
}
// The cluster kernel takes each channel's maximum in parts, in another order
// than the CPU: with every maximum a tie of +0 and -0 the weights, so the
// records, are still the same bits.
TEST_F(Compressor, C128ADecodeGatesTieAtZero) {
  CompSpec spec{128, 512, EntryFormat::kFp8DsMla, false, c128a_decode_runs(), false, 77, kOneToken};
  spec.zero_tie_gates = true;
  run_compressor(spec);
}
// A decode token at a block end whose state pages are unmapped (its row
// slot negative, its window absent) but whose entry has a slot: the cluster
// kernel reads and writes no state row (the caches otherwise the CPU's bits).
TEST_F(Compressor, C128ADecodeWithoutStatePages) {
  CompSpec spec{128, 512, EntryFormat::kFp8DsMla, false, {{255, 1}, {383, 1}}, false, 78, kOneToken};
  spec.unmapped_run = 0;
  run_compressor(spec);
}
// The cluster kernel's stamped instantiation (set_compressor_wide_stamps,
// fused_bench --stamps): the same bits, and for the tokens that complete an
// entry every CTA's stamps in order.
TEST_F(Compressor, WideStampsLeaveTheEntryAlone) {
  const std::vector<RunSpec> runs = c128a_decode_runs();
  const size_t ctas = cuda::kWideSplit * (runs.size() + 2), per = cuda::kWideStampCount;  // the test's 2 padding tokens
  DeviceArray<unsigned long long> stamps(std::vector<unsigned long long>(ctas * per, 0));
  cuda::set_compressor_wide_stamps(stamps.get());
  run_compressor({128, 512, EntryFormat::kFp8DsMla, false, runs, false, 74, kOneToken});
  cuda::set_compressor_wide_stamps(nullptr);
  const std::vector<unsigned long long> h = stamps.download();
  int stamped = 0;
  for (size_t r = 0; r < runs.size(); ++r) {
    if ((runs[r].start + 1) % 128 != 0) continue;  // completes no entry: the CTAs leave after the wait
    for (size_t cta = 8 * r; cta < 8 * r + 8; ++cta, ++stamped)
      for (size_t pt = 0; pt < per; ++pt) {
        ASSERT_NE(h[cta * per + pt], 0u) << "CTA " << cta << " point " << cuda::kWideStampNames[pt];
        if (pt > 0) EXPECT_LE(h[cta * per + pt - 1], h[cta * per + pt]) << "CTA " << cta << " point " << pt;
      }
  }
  EXPECT_EQ(stamped, 24);  // 127, 255 and 1048575 complete entries
}
TEST_F(Compressor, C4ADecodeCachesPast2GiB) {
  run_compressor({4, 512, EntryFormat::kFp8DsMla, false, {{7, 1}, {1048575, 1}}, true, 75, kOneToken});
}

// kRuns steps (what the engine launches for any step with a run of several
// tokens): one kernel whose CTAs write their rows and pool their entries
// (the launcher's rule: at m = 4 quad_kernel from 2,048 tokens, 8,192 for
// the indexer's, below them 4 tokens a CTA of span_kernel; C128A on clusters
// over the shortest spans of 16-128 tokens that fit in a wave). The runs of
// the kAny tests under the rule, on the quad kernel (kQuad) and with spans
// forced (span_kernel, or C128A's clusters of that many tokens): 1 token a
// CTA, 3, 7, the largest; -1 asks for kAny's two kernels.
constexpr int kQuad = -2;
CompSpec runs_spec(int m, int c, EntryFormat record, std::vector<RunSpec> runs, uint64_t seed, int span,
                   int kernels) {
  CompSpec spec{m, c, record, c == 128, std::move(runs), false, seed, cuda::CompressorLaunch::kRuns};
  spec.span = span == kQuad ? 0 : span;
  spec.quad_from = span == kQuad ? 0 : -1;
  spec.kernels = kernels;
  return spec;
}
constexpr EntryFormat kMla = EntryFormat::kFp8DsMla;
TEST_F(Compressor, C4AMainRuns) { run_compressor(runs_spec(4, 512, kMla, c4a_runs(), 81, kQuad, 1)); }
TEST_F(Compressor, C4AIndexerFp8KeysRuns) {
  run_compressor(runs_spec(4, 128, EntryFormat::kIndexFp8, c4a_runs(), 82, kQuad, 1));
}
TEST_F(Compressor, C4AIndexerMxfp4KeysRuns) {
  run_compressor(runs_spec(4, 128, EntryFormat::kIndexMxfp4, c4a_runs(), 83, kQuad, 1));
}
TEST_F(Compressor, C128AMainRuns) { run_compressor(runs_spec(128, 512, kMla, c128a_runs(), 84, 0, 1)); }
TEST_F(Compressor, C4APrefillChunkRuns) {
  run_compressor(runs_spec(4, 512, kMla, {{4096, 2048}, {37, 515}}, 85, 0, 1));
}
TEST_F(Compressor, C4AIndexerLongChunkRuns) {
  run_compressor(runs_spec(4, 128, EntryFormat::kIndexMxfp4, {{4096, 8200}, {37, 515}}, 86, 0, 1));
}
TEST_F(Compressor, C4AIndexerShortStepRuns) {
  run_compressor(runs_spec(4, 128, EntryFormat::kIndexMxfp4, c4a_runs(), 99, 0, 1));
}
TEST_F(Compressor, C128APrefillChunkRuns) {  // clusters of 64 tokens
  run_compressor(runs_spec(128, 512, kMla, {{0, 1000}, {4000, 700}}, 87, 0, 1));
}
TEST_F(Compressor, C128ALongChunkRuns) {
  run_compressor(runs_spec(128, 512, kMla, {{200, 4100}}, 100, 0, 1));
}
// C128A's spans under the rule: the shortest of 16, 32, 64 and 128 tokens
// whose clusters are fewer than the device holds at once (30 on an H100),
// else 128 tokens while those fit in a wave, else 64. Chunks of 600 and
// 2,500 tokens take 32 and 128 on today's GPUs; and the 128-token spans
// forced on a chunk that starts inside a block (each entry's rows in two
// clusters' spans and the state).
int expected_c128a_span(int tokens, int wave) {
  for (int span = 16; span <= 128; span *= 2)
    if ((tokens + span - 1) / span < wave) return span;
  return (tokens + 127) / 128 <= wave ? 128 : 64;
}
TEST_F(Compressor, C128AOneWaveChunkRuns) {
  const int wave = cuda::compressor_c128a_resident_clusters();
  std::printf("C128A's kRuns kernel: %d clusters resident; spans of %d, %d, %d and %d tokens at 600, 2,500, "
              "4,096 and 8,192 tokens\n",
              wave, cuda::compressor_c128a_span(600), cuda::compressor_c128a_span(2500),
              cuda::compressor_c128a_span(4096), cuda::compressor_c128a_span(8192));
  for (int tokens : {1, 128, 600, 960, 1920, 2500, 3840, 4096, 8192})
    EXPECT_EQ(cuda::compressor_c128a_span(tokens), expected_c128a_span(tokens, wave)) << tokens << " tokens";
  run_compressor(runs_spec(128, 512, kMla, {{0, 2500}}, 102, 0, 1));
  run_compressor(runs_spec(128, 512, kMla, {{0, 600}}, 104, 0, 1));
}
TEST_F(Compressor, C128ABlockSpansRuns) {
  run_compressor(runs_spec(128, 512, kMla, {{300, 2500}, {37, 100}}, 103, 128, 1));
}
TEST_F(Compressor, C4ARunsOneTokenACta) {
  run_compressor(runs_spec(4, 512, kMla, {{10, 37}, {0, 4}, {1048570, 6}}, 88, 1, 1));
}
TEST_F(Compressor, C4AIndexerRunsThreeTokensACta) {
  run_compressor(runs_spec(4, 128, EntryFormat::kIndexFp8, {{10, 37}, {1, 9}, {1048560, 16}}, 89, 3, 1));
}
TEST_F(Compressor, C128ARunsSevenTokensACta) {
  run_compressor(runs_spec(128, 512, kMla, {{200, 150}, {0, 300}, {1048575, 1}}, 90, 7, 1));
}
TEST_F(Compressor, C4ARunsLargestSpan) {
  run_compressor(runs_spec(4, 512, kMla, {{4096, 1100}, {37, 515}}, 91, 100000, 1));
}
TEST_F(Compressor, C4ARunsTwoKernelsAskedFor) { run_compressor(runs_spec(4, 512, kMla, c4a_runs(), 92, -1, 2)); }
TEST_F(Compressor, C4ARunsCachesPast2GiB) {
  CompSpec spec = runs_spec(4, 512, kMla, {{10, 37}, {1048572, 4}}, 94, kQuad, 1);
  spec.big = true;
  run_compressor(spec);
}
TEST_F(Compressor, C128ARunsCachesPast2GiB) {
  CompSpec spec = runs_spec(128, 512, kMla, {{200, 150}, {1048575, 1}}, 95, 0, 1);
  spec.big = true;
  run_compressor(spec);
}
// Rows of the step in every pooled window but one unmapped run: nothing of
// its state may be read or written, its entries pool its rows of this step.
TEST_F(Compressor, C4ARunsWithoutStatePages) {
  CompSpec spec = runs_spec(4, 512, kMla, {{10, 37}, {100, 20}}, 96, kQuad, 1);
  spec.unmapped_run = 1;
  run_compressor(spec);
}
// C128A's cluster kernel with several entries a cluster (in token order on
// every CTA: spans of 256 tokens, two clusters pool 2 and 4 entries), and
// C128A on the one-CTA kernel.
TEST_F(Compressor, C128ARunsManyEntriesACluster) {
  run_compressor(runs_spec(128, 512, kMla, {{0, 256}, {127, 1}, {255, 1}, {1048575, 1}, {383, 1}}, 97, 256, 1));
}
TEST_F(Compressor, C128ARunsOneCta) {
  CompSpec spec = runs_spec(128, 512, kMla, {{200, 150}, {0, 300}, {1048575, 1}}, 98, 16, 1);
  spec.clusters = false;
  run_compressor(spec);
}

// The kRuns cluster kernel's stamped instantiation (fused_bench
// --span-stamps): the same bits, every CTA's points in order, and the
// entry's points exactly on the clusters whose span completes one (300
// tokens from position 0 and the 2 padding tokens in spans of 64: clusters
// 1 and 3 hold positions 127 and 255).
TEST_F(Compressor, SpanWideStampsLeaveTheEntriesAlone) {
  constexpr int kSpan = 64, kClusters = (300 + 2 + kSpan - 1) / kSpan;
  const size_t per = cuda::kWideStampCount;
  DeviceArray<unsigned long long> stamps(std::vector<unsigned long long>(kClusters * cuda::kWideSplit * per, 0));
  cuda::set_compressor_wide_stamps(stamps.get());
  run_compressor(runs_spec(128, 512, kMla, {{0, 300}}, 101, kSpan, 1));
  cuda::set_compressor_wide_stamps(nullptr);
  const std::vector<unsigned long long> h = stamps.download();
  for (int c = 0; c < kClusters; ++c) {
    const bool entry = c == 1 || c == 3;
    for (size_t cta = size_t(c) * cuda::kWideSplit; cta < size_t(c + 1) * cuda::kWideSplit; ++cta) {
      unsigned long long prev = 0;
      for (size_t pt = 0; pt < per; ++pt) {
        const unsigned long long v = h[cta * per + pt];
        const bool expected = entry || pt <= 2 || pt == per - 1;
        ASSERT_EQ(v != 0, expected) << "cluster " << c << " CTA " << cta << " point "
                                    << cuda::kSpanWideStampNames[pt];
        if (!v) continue;
        EXPECT_LE(prev, v) << "CTA " << cta << " point " << cuda::kSpanWideStampNames[pt];
        prev = v;
      }
    }
  }
}

// The state blocks as the block manager gives them pages (live_state_only:
// none for a block the step's own tokens fill and no later token reads):
// the caches the CPU's bits, and the records the same bits as with every
// block mapped, on each kernel the engine's steps take.
void check_live_state_only(CompSpec spec) {
  std::vector<uint8_t> full, live;
  run_compressor(spec, &full);
  spec.live_state_only = true;
  run_compressor(spec, &live);
  ASSERT_EQ(full.size(), live.size());
  const int64_t o = first_diff(full.data(), live.data(), full.size());
  EXPECT_EQ(o, -1) << "records differ without the dead blocks' pages at byte " << o;
}
TEST_F(Compressor, C4AMainLiveStateOnly) {  // the quad kernel
  check_live_state_only(runs_spec(4, 512, kMla, {{4096, 2048}, {37, 515}, {10, 37}}, 101, kQuad, 1));
}
TEST_F(Compressor, C4AMainLiveStateOnlyRule) {  // 1,752 tokens: 4 tokens a CTA
  check_live_state_only(runs_spec(4, 512, kMla, {{4096, 1200}, {37, 515}, {10, 37}}, 108, 0, 1));
}
TEST_F(Compressor, C4AMainLiveStateOnlyTwoKernels) {
  check_live_state_only(runs_spec(4, 512, kMla, {{4096, 2048}, {37, 515}, {10, 37}}, 102, -1, 2));
}
TEST_F(Compressor, C4AIndexerLiveStateOnly) {
  check_live_state_only(runs_spec(4, 128, EntryFormat::kIndexMxfp4, {{4096, 1500}, {0, 37}}, 103, 0, 1));
}
TEST_F(Compressor, C128ALiveStateOnly) {  // clusters of 64 tokens
  check_live_state_only(runs_spec(128, 512, kMla, {{0, 1000}, {4000, 700}}, 104, 0, 1));
}
TEST_F(Compressor, C128ALiveStateOnlyTwoKernels) {
  check_live_state_only(runs_spec(128, 512, kMla, {{200, 4100}}, 105, -1, 2));
}
TEST_F(Compressor, C128ALiveStateOnlyOneCta) {
  CompSpec spec = runs_spec(128, 512, kMla, {{0, 1000}, {4000, 700}}, 106, 16, 1);
  spec.clusters = false;
  check_live_state_only(spec);
}
TEST_F(Compressor, C4ALiveStateOnlyAnyStep) {  // kAny: the entries kernel
  CompSpec spec{4, 512, kMla, false, {{4096, 600}, {10, 37}}, false, 107};
  spec.kernels = 2;
  check_live_state_only(spec);
}

TEST_F(Compressor, ZeroTokensLaunchNothing) {
  CompressorParams p;
  p.ratio = 4;
  p.dim = 512;
  cuda::compressor_cuda(p, nullptr);
  sync_and_check("compressor_cuda, T = 0");
}

// ---- compress_cpu against the direct formula (no device needed) ---------------------------

// Entry j of run r straight from SPEC §4.3 in double precision: softmax of
// the gates per channel over the pooled rows (m = 4: A half of block j-1, B
// half of block j), weighted sum, then RMSNorm and RoPE at j*m in float.
std::vector<float> direct_entry(const CompCase& k, int r, int64_t j) {
  const int m = k.spec.m, c = k.spec.c;
  std::vector<float> v(static_cast<size_t>(c));
  for (int e = 0; e < c; ++e) {
    std::vector<std::pair<double, double>> ag;
    for (int64_t p = m == 4 ? std::max<int64_t>(0, (j - 1) * m) : j * m; p < j * m + m; ++p) {
      const std::vector<float>& row = k.rows.at({r, p});
      const int col = (m == 4 && p >= j * m) ? c + e : e;
      ag.emplace_back(row[size_t(col)], row[size_t(k.kc + col)]);
    }
    double mx = -1e300, den = 0, num = 0;
    for (auto [a, g] : ag) mx = std::max(mx, g);
    for (auto [a, g] : ag) den += std::exp(g - mx), num += std::exp(g - mx) * a;
    v[size_t(e)] = float(num / den);
  }
  rms_norm(v.data(), k.norm.data(), c, kEps, v.data());
  k.rope.apply(v.data() + c - kRopeDim, j * m);
  return v;
}

void check_cpu_exact(int m, int c, const std::vector<RunSpec>& runs, uint64_t seed) {
  CompSpec spec{m, c, EntryFormat::kF32, false, runs, false, seed};
  CompCase k = make_case(spec);
  // Output pages of c floats per entry.
  k.o_stride = entry_page_stride(EntryFormat::kF32, k.Bo, c);
  k.out.assign(k.o_stride * size_t(k.o_pages), 0);
  CompressorParams p =
      k.params(k.proj.data(), k.ape.data(), k.norm.data(), k.positions.data(), k.token_run.data(), k.row_slot.data(),
               k.entry_slot.data(), k.table_pages.data(), k.table_first.data(), k.state.data(), k.out.data());
  p.bf16_rounding = false;
  compress_cpu(p);
  int entries = 0;
  for (int t = 0; t < k.T; ++t) {
    const int64_t slot = k.entry_slot[size_t(t)];
    if (slot < 0 || slot >= k.o_cap()) continue;
    ++entries;
    const int64_t j = (k.positions[size_t(t)] + 1) / m - 1;
    const std::vector<float> want = direct_entry(k, k.token_run[size_t(t)], j);
    const float* got = reinterpret_cast<const float*>(k.out.data() + size_t(slot / k.Bo) * k.o_stride) +
                       size_t(c) * size_t(slot % k.Bo);
    // fp32 pooling against double: a few float roundings of O(1) values,
    // amplified by at most the norm's factor (inputs are O(1)).
    for (int e = 0; e < c; ++e)
      ASSERT_NEAR(got[e], want[size_t(e)], 2e-5 * (1 + std::fabs(want[size_t(e)])))
          << "token " << t << " (position " << k.positions[size_t(t)] << ", slot " << j << ") channel " << e;
  }
  EXPECT_GT(entries, 0);
  // The state rows: [a | g + ape] of every token at its row slot.
  for (int t = 0; t < k.T; ++t) {
    const int64_t slot = k.row_slot[size_t(t)];
    if (slot < 0 || slot >= k.s_cap()) continue;
    const float* row = reinterpret_cast<const float*>(k.state.data() + size_t(slot / k.Bs) * k.s_stride) +
                       size_t(k.row_floats) * size_t(slot % k.Bs);
    const std::vector<float>& want = k.rows.at({k.token_run[size_t(t)], k.positions[size_t(t)]});
    for (int i = 0; i < k.row_floats; ++i) ASSERT_EQ(row[i], want[size_t(i)]) << "token " << t << " float " << i;
  }
}

TEST(CompressCpu, C4AMatchesTheDirectFormula) { check_cpu_exact(4, 512, c4a_runs(), 61); }
TEST(CompressCpu, C4AIndexerMatchesTheDirectFormula) { check_cpu_exact(4, 128, c4a_runs(), 62); }
TEST(CompressCpu, C128AMatchesTheDirectFormula) { check_cpu_exact(128, 512, c128a_runs(), 63); }

// The CPU twin with the state blocks as the block manager gives them pages:
// the same records as with every block mapped (a step's rows are pooled
// from its projection), and no state byte written outside the live blocks.
void check_cpu_live_state_only(CompSpec spec) {
  auto records = [](const CompSpec& s, std::vector<uint8_t>* state) {
    CompCase k = make_case(s);
    const CompressorParams p =
        k.params(k.proj.data(), k.ape.data(), k.norm.data(), k.positions.data(), k.token_run.data(),
                 k.row_slot.data(), k.entry_slot.data(), k.table_pages.data(), k.table_first.data(), k.state.data(),
                 k.out.data());
    const std::vector<uint8_t> before = k.state;
    compress_cpu(p);
    if (state) *state = before;
    return std::make_pair(k.out, k.state);
  };
  const auto [full_out, full_state] = records(spec, nullptr);
  spec.live_state_only = true;
  std::vector<uint8_t> before;
  const auto [live_out, live_state] = records(spec, &before);
  EXPECT_EQ(first_diff(full_out.data(), live_out.data(), full_out.size()), -1) << "records differ";
  // Every state byte the live case wrote, the full case wrote the same.
  int64_t written = 0;
  for (size_t i = 0; i < live_state.size(); ++i) {
    if (live_state[i] == before[i]) continue;
    ++written;
    ASSERT_EQ(live_state[i], full_state[i]) << "state byte " << i;
  }
  EXPECT_GT(written, 0);
  EXPECT_NE(first_diff(full_state.data(), live_state.data(), full_state.size()), -1);  // the dead rows
}
TEST(CompressCpu, C4AWithoutTheDeadStateBlocks) {
  check_cpu_live_state_only({4, 512, EntryFormat::kFp8DsMla, false, {{4096, 600}, {10, 37}, {0, 4}}, false, 65});
}
TEST(CompressCpu, C128AWithoutTheDeadStateBlocks) {
  check_cpu_live_state_only({128, 512, EntryFormat::kFp8DsMla, false, {{0, 1000}, {200, 150}}, false, 66});
}

TEST(CompressCpu, BadParamsThrow) {
  CompCase k = make_case({4, 512, EntryFormat::kFp8DsMla, false, {{0, 4}}, false, 64});
  const CompressorParams p =
      k.params(k.proj.data(), k.ape.data(), k.norm.data(), k.positions.data(), k.token_run.data(), k.row_slot.data(),
               k.entry_slot.data(), k.table_pages.data(), k.table_first.data(), k.state.data(), k.out.data());
  EXPECT_NO_THROW(check_compressor_params(p));
  auto bad = p;
  bad.ratio = 8;
  EXPECT_THROW(check_compressor_params(bad), Error);
  bad = p;
  bad.record = EntryFormat::kIndexMxfp4;  // needs dim 128
  EXPECT_THROW(check_compressor_params(bad), Error);
  bad = p;
  bad.proj_ld = bad.g_col() + bad.kc() - 4;
  EXPECT_THROW(check_compressor_params(bad), Error);
  bad = p;
  bad.state_table.entries_per_page = 64;
  EXPECT_THROW(check_compressor_params(bad), Error);
  bad = p;
  bad.out.page_stride -= 16;
  EXPECT_THROW(check_compressor_params(bad), Error);
  // The GPU's own: f32 records and exact numerics are CPU only.
  bad = p;
  bad.record = EntryFormat::kF32;
  bad.out.page_stride = entry_page_stride(EntryFormat::kF32, bad.out.entries_per_page, 512);
  EXPECT_NO_THROW(check_compressor_params(bad));
  EXPECT_THROW(cuda::check_compressor_cuda_params(bad), Error);
  bad = p;
  bad.bf16_rounding = false;
  EXPECT_THROW(cuda::check_compressor_cuda_params(bad), Error);
  bad = p;
  bad.hadamard = true;  // 512-dim entries
  EXPECT_THROW(cuda::check_compressor_cuda_params(bad), Error);
}

// ---- exp_f32 ----------------------------------------------------------------------------

// Every 97th float of [-104, 89] and a few special values.
std::vector<float> exp_inputs() {
  std::vector<float> x = {0.0f, -0.0f, 1e-30f, -1e-30f, -103.97f, -103.98f, -104.0f, -87.5f, 88.72f, 88.73f, 89.0f,
                          std::bit_cast<float>(0x7f800000u), std::bit_cast<float>(0xff800000u),
                          std::bit_cast<float>(0x7fc00000u)};
  for (uint32_t b = 0x80000000u; b <= std::bit_cast<uint32_t>(-104.0f); b += 97) x.push_back(std::bit_cast<float>(b));
  for (uint32_t b = 0; b <= std::bit_cast<uint32_t>(89.0f); b += 97) x.push_back(std::bit_cast<float>(b));
  return x;
}

TEST(ExpF32, WithinTwoUlpOfExp) {
  double worst = 0;
  float worst_x = 0;
  for (float x : exp_inputs()) {
    const float got = pool::exp_f32(x);
    const double want = std::exp(double(x));
    if (std::isnan(x)) {
      ASSERT_TRUE(std::isnan(got));
      continue;
    }
    const float wf = float(want);
    if (std::isinf(wf) || wf == 0) {  // overflow or underflow: the same, or the neighbouring float
      ASSERT_TRUE(got == wf || std::nextafter(got, wf) == wf) << "x " << x << " got " << got << " want " << want;
      continue;
    }
    const double ulp = double(std::nextafter(wf, INFINITY)) - double(wf);
    const double err = std::fabs(double(got) - want) / ulp;
    if (err > worst) worst = err, worst_x = x;
  }
  std::printf("    exp_f32: max error %.3f ulp (at x = %.9g)\n", worst, double(worst_x));
  EXPECT_LE(worst, 2.0);
}

__global__ void exp_kernel(const float* x, float* y, int n) {
  const int i = int(blockIdx.x * blockDim.x + threadIdx.x);
  if (i < n) y[i] = pool::exp_f32(x[i]);
}

TEST_F(Compressor, ExpF32IsTheSameOnTheDevice) {
  const std::vector<float> x = exp_inputs();
  DeviceArray<float> d_x(x), d_y(x.size());
  d_y.fill_bytes(0xff);
  exp_kernel<<<unsigned((x.size() + 255) / 256), 256>>>(d_x.get(), d_y.get(), int(x.size()));
  sync_and_check("exp_kernel");
  const std::vector<float> y = d_y.download();
  for (size_t i = 0; i < x.size(); ++i) {
    const float h = pool::exp_f32(x[i]);
    ASSERT_EQ(std::bit_cast<uint32_t>(y[i]), std::bit_cast<uint32_t>(h))
        << "x " << x[i] << " (" << hex(std::bit_cast<uint32_t>(x[i])) << "): device " << y[i] << " host " << h;
  }
}

}  // namespace
}  // namespace dsv4::test::fused
