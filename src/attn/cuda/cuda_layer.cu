#include "attn/cuda/cuda_layer.h"

#include <cuda_runtime.h>

#include <cmath>
#include <string>

#include "attn/compressor_params.h"
#include "attn/cuda/compressor_cuda.h"
#include "attn/cuda/device_cache.h"
#include "attn/cuda/indexer_queries_cuda.h"
#include "attn/cuda/indexer_select_cuda.h"
#include "attn/cuda/out_rope.h"
#include "attn/cuda/q_head_norm_rope.h"
#include "attn/cuda/qkv_norm_rope.h"
#include "attn/cuda/sparse_attention_cuda.h"
#include "cache/entries.h"
#include "cache/fp8_ds_mla.h"
#include "common/error.h"

namespace dsv4::cuda {
namespace {

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw Error(std::string("cuda layer: ") + what + ": " + cudaGetErrorString(e));
}

// Columns of the stacked bf16 projection (StepBuffers::proj): the main
// compressor's wkv | wgate (k*512 each), then for C4A the indexer
// compressor's wkv | wgate (2*128 each) and weights_proj (nI). Each
// compressor's gates follow its values (CompressorParams::g_col).
struct ProjColumns {
  int a = 0, idx_a = 0, weights = 0;
};
ProjColumns proj_columns(LayerType t) {
  const int kc = (t == LayerType::kC4A ? 2 : 1) * kKvDim;
  ProjColumns c;
  c.idx_a = 2 * kc;
  c.weights = c.idx_a + 2 * 2 * kIndexDim;
  return c;
}

std::vector<const WeightMatrix*> proj_parts(const LayerWeights& w) {
  std::vector<const WeightMatrix*> parts;
  if (!w.compressor) return parts;
  parts = {&w.compressor->wkv, &w.compressor->wgate};
  if (w.indexer)
    for (const WeightMatrix* m : {&w.indexer->compressor.wkv, &w.indexer->compressor.wgate, &w.indexer->weights_proj})
      parts.push_back(m);
  return parts;
}

void require_fp8(const WeightMatrix& m) {
  DSV4_REQUIRE(m.is_fp8(), "cuda backend: " + m.name +
                               " is not FP8; the CUDA backend runs checkpoints with FP8 linears (SPEC §3) only");
}

// Rows [r0, r0 + n) of an FP8 matrix as a matrix of its own, its bytes shared:
// valid when the rows lie inside one 128-row block of scales or start at one.
WeightMatrix fp8_row_slice(const WeightMatrix& w, int64_t r0, int64_t n) {
  DSV4_REQUIRE(r0 % 128 == 0 || r0 / 128 == (r0 + n - 1) / 128,
               "cuda backend: rows " + std::to_string(r0) + ".." + std::to_string(r0 + n - 1) + " of " + w.name +
                   " straddle its 128-row scale blocks");
  WeightMatrix s;
  s.name = w.name + "[" + std::to_string(r0) + ":" + std::to_string(r0 + n) + "]";
  s.rows = n, s.cols = w.cols, s.dtype = w.dtype;
  s.data = w.data.subspan(size_t(r0 * w.cols), size_t(n * w.cols));
  const int64_t sc = w.scale_cols(), b0 = r0 / 128, b1 = (r0 + n - 1) / 128;
  s.block_scales.assign(w.block_scales.begin() + b0 * sc, w.block_scales.begin() + (b1 + 1) * sc);
  return s;
}

// wo_a runs as one grouped linear when its groups start at 128-row scale
// blocks, else as one linear per group on its rows.
bool wo_a_per_group(const ModelConfig& c) { return c.o_lora_rank % 128 != 0; }

const std::vector<float>& ape_or_empty(const std::optional<CompressorWeights>& c) {
  static const std::vector<float> none;
  return c ? c->ape : none;
}

// ---- golden-replay captures: device tensors read back to the host ----------

std::vector<float> download_bf16(const uint16_t* d, int64_t rows, int64_t cols, int64_t ld) {
  std::vector<uint16_t> bits(size_t(rows * cols));
  check(cudaMemcpy2D(bits.data(), size_t(cols) * 2, d, size_t(ld) * 2, size_t(cols) * 2, size_t(rows),
                     cudaMemcpyDeviceToHost),
        "capture copy");
  std::vector<float> out(bits.size());
  for (size_t i = 0; i < bits.size(); ++i) out[i] = bf16_to_float(bits[i]);
  return out;
}

std::vector<int32_t> download_ints(const int32_t* d, int64_t n) {
  std::vector<int32_t> v(static_cast<size_t>(n));
  check(cudaMemcpy(v.data(), d, size_t(n) * 4, cudaMemcpyDeviceToHost), "capture copy");
  return v;
}

// Entry `slot` of a device arena, decoded on the host through a copy of its page.
void read_device_entry(const KvPagesMut& dev, EntryFormat f, int dim, int32_t slot, float* out) {
  std::vector<uint8_t> page(dev.page_stride);
  check(cudaMemcpy(page.data(), dev.page(slot / dev.entries_per_page), dev.page_stride, cudaMemcpyDeviceToHost),
        "capture copy");
  const EntryArena host{KvPagesMut{page.data(), 1, dev.entries_per_page, dev.page_stride}, f, dim};
  host.read(slot % dev.entries_per_page, out);
}

// Entries completed in the step (tokens with slots[t] >= 0), in token order.
void capture_entries(const std::vector<int32_t>& slots, int real, const KvPagesMut& dev, EntryFormat f, int dim,
                     std::vector<int>& tokens, std::vector<float>& out) {
  for (int t = 0; t < real; ++t) {
    if (slots[size_t(t)] < 0) continue;
    tokens.push_back(t);
    out.resize(out.size() + size_t(dim));
    read_device_entry(dev, f, dim, slots[size_t(t)], out.data() + out.size() - size_t(dim));
  }
}

// The row count from which a linear takes cuBLASLt (multiples of 8) before
// small_m_max: where cuBLASLt beats the own split-K kernel in the step, not
// only alone (docs/perf-notes.md, runs K1-K2): wq_a+wkv, wo_b and
// indexer.wq_b from 16 rows, wq_b from 32. (Alone, indexer.wq_b wins from 8
// rows, but the batch-8 step did not get faster.) Options that set
// cublas_from themselves keep it.
LinearOptions cublas_from(LinearOptions o, int rows) {
  if (o.cublas_from == 0) o.cublas_from = rows;
  return o;
}

// The rows an FP8 linear takes the own wgmma GEMM for, before cuBLASLt and
// the small-M kernel (docs/perf-notes.md, runs R4, T1-T2 and U1-U2):
// wq_a+wkv, wq_b and indexer.wq_b at 1-64 rows, wo_b at 1-32. At 128 rows
// cuBLASLt is faster for all but wq_a+wkv (level), and the 128-row steps
// were slower with it. Below 8 rows the GEMM is faster alone (wq_b at one
// row: 8.2 against 10.6 us) but made the batch-1 step slower (3.74-4.04
// against 3.57 ms) until its weight copies took the L2 evict-first policy:
// then 3.29-3.32 ms, and 3.38-3.54 at 2-4 rows (3.64-3.87 on the small-M
// kernel). wo_a (FP8 weight x bf16 activation) takes it only at 16-64 rows:
// there its steps were 2-4% faster (64 rows: 23.6 against cuBLASLt's 29.9
// us); at 1-8 rows its decode into bf16 fragments makes it slower than the
// small-M kernel (batch 1: 3.40 against 3.19 ms), and at 128 rows its
// one-CTA tile is still behind cuBLASLt (33.2 against 32.7 us; the 128-row
// steps 0.9-1.2% slower with it). At 96 rows it was faster alone (29.5
// against 30.9 us), but the 96-row step was level with it (within 0.7%),
// so it is not routed there (docs/perf-notes.md, runs Y1-Y2, BF1-BF2, BG4,
// BH2).
// Options that set gemm_from themselves keep theirs.
LinearOptions gemm_rows(LinearOptions o, int max, int from = 1) {
  if (o.gemm_from == 0) o.gemm_from = from, o.gemm_max = max;
  return o;
}

int real_tokens(const StepBuffers& b) {
  int n = 0;
  check(cudaMemcpy(&n, b.real_tokens, 4, cudaMemcpyDeviceToHost), "capture copy");
  return n;
}

}  // namespace

DeviceFloats::DeviceFloats(const std::vector<float>& host) : n_(host.size()) {
  if (n_ == 0) return;
  check(cudaMalloc(&p_, n_ * sizeof(float)), "cudaMalloc");
  check(cudaMemcpy(p_, host.data(), n_ * sizeof(float), cudaMemcpyHostToDevice), "weight upload");
}

DeviceFloats::~DeviceFloats() { cudaFree(p_); }

CudaLayer::CudaLayer(const ModelConfig& config, const LayerWeights& w, IndexKeyFormat keys,
                     const LinearOptions& linear)
    : config_(config), layer_(w.layer), type_(w.type), keys_(keys), rope_(config.rope_params(w.type)),
      wqkv_((require_fp8(w.wq_a), require_fp8(w.wkv), std::vector<const WeightMatrix*>{&w.wq_a, &w.wkv}),
            gemm_rows(cublas_from(linear, 16), 64)),
      wq_b_((require_fp8(w.wq_b), w.wq_b), gemm_rows(cublas_from(linear, 32), 64)),
      wo_b_((require_fp8(w.wo_b), w.wo_b), gemm_rows(cublas_from(linear, 16), 32)),
      q_norm_(w.q_norm), kv_norm_(w.kv_norm), sink_(w.attn_sink), ape_(ape_or_empty(w.compressor)),
      norm_(w.compressor ? w.compressor->norm : std::vector<float>{}),
      idx_ape_(w.indexer ? w.indexer->compressor.ape : std::vector<float>{}),
      idx_norm_(w.indexer ? w.indexer->compressor.norm : std::vector<float>{}) {
  require_fp8(w.wo_a);
  if (!wo_a_per_group(config)) wo_a_.emplace_back(w.wo_a, config.o_groups, W8A16Options{gemm_rows(linear, 64, 16)});
  else
    for (int g = 0; g < config.o_groups; ++g)  // each slice is uploaded here; none is kept
      wo_a_.emplace_back(fp8_row_slice(w.wo_a, int64_t(g) * config.o_lora_rank, config.o_lora_rank), 1,
                         W8A16Options{linear});
  if (w.compressor) proj_.emplace(proj_parts(w), linear);
  if (w.indexer) {
    require_fp8(w.indexer->wq_b);
    idx_wq_b_.emplace(w.indexer->wq_b, gemm_rows(cublas_from(linear, 16), 64));
  }
}

Lane CudaLayer::heads_lane() const { return idx_wq_b_ ? Lane::kHeads : Lane::kMain; }

std::vector<LinearNeeds> CudaLayer::needs(int max_m, Lane lane) const {
  std::vector<LinearNeeds> n;
  if (lane == Lane::kMain) {
    n = {wqkv_.needs(max_m), wo_b_.needs(max_m)};
    for (const W8A16GroupedLinear& l : wo_a_) n.push_back(l.needs(max_m));
    if (idx_wq_b_) n.push_back(idx_wq_b_->needs(max_m));
  }
  if (lane == heads_lane()) n.push_back(wq_b_.needs(max_m));
  if (lane == Lane::kCompress && proj_) n.push_back(proj_->needs(max_m));
  return n;
}

int64_t CudaLayer::device_bytes() const {
  int64_t n = int64_t(wqkv_.device_bytes() + wq_b_.device_bytes() + wo_b_.device_bytes());
  for (const W8A16GroupedLinear& l : wo_a_) n += int64_t(l.device_bytes());
  if (proj_) n += int64_t(proj_->device_bytes());
  if (idx_wq_b_) n += int64_t(idx_wq_b_->device_bytes());
  for (const DeviceFloats* f : {&q_norm_, &kv_norm_, &sink_, &ape_, &norm_, &idx_ape_, &idx_norm_})
    n += int64_t(f->size() * sizeof(float));
  return n;
}

void CudaLayer::project_q_kv(StepBuffers& b) {
  const int T = b.tokens, R = config_.q_lora_rank, H = config_.num_heads;
  wqkv_.forward(b.x8, b.qkv, R + kKvDim, b.linear(Lane::kMain), b.stream);
  QkvNormRopeParams p;
  p.num_tokens = T;
  p.q_lora = R;
  p.qkv = b.qkv;
  p.qkv_ld = R + kKvDim;
  p.q_norm = q_norm_.get();
  p.kv_norm = kv_norm_.get();
  p.eps = float(config_.rms_norm_eps);
  p.positions = b.step.positions;
  p.rope = &rope_;
  p.cq_fp8 = b.cq8;  // cq in the FP8 form wq_b and the indexer's wq_b read; no bf16 copy (p.cq)
  p.swa = b.cache->pages(layer_, CacheKind::kSwa);
  p.swa_slot = b.step.swa_slot;
  qkv_norm_rope_cuda(p, b.stream);
  // q's heads: on their own lane while the main lane runs the indexer (C4A).
  const Lane h = heads_lane();
  if (h != Lane::kMain) {
    lane_mark(b, Lane::kMain, LanePoint::kCq);
    lane_wait(b, h, LanePoint::kCq);
  }
  // q's per-head norm and RoPE: fused into wq_b's kernel where it can be
  // (decode); the separate kernel reads the step's table of the rotation.
  const QHeadNormRopeParams heads{T, H, b.q, int64_t(H) * kKvDim, float(config_.rms_norm_eps), b.step.positions, &rope_,
                                  b.out_rope_cs[int(type_)]};
  if (!wq_b_.forward(b.cq8, b.q, int64_t(H) * kKvDim, b.linear(h), b.on(h), LinearTail{.q_head = &heads}))
    q_head_norm_rope_cuda(heads, b.on(h));
  if (h != Lane::kMain) lane_mark(b, h, LanePoint::kHeads);
}

void CudaLayer::compress(StepBuffers& b) {
  if (!proj_) return;
  // The compressors read only the layer input: their lane starts at once.
  lane_mark(b, Lane::kMain, LanePoint::kLayerInput);
  lane_wait(b, Lane::kCompress, LanePoint::kLayerInput);
  CUstream_st* const stream = b.on(Lane::kCompress);
  proj_->forward(b.x, config_.hidden_size, b.tokens, b.proj, b.proj_ld, b.linear(Lane::kCompress), stream);
  lane_mark(b, Lane::kCompress, LanePoint::kProj);
  const bool c4a = type_ == LayerType::kC4A;
  const ProjColumns col = proj_columns(type_);
  CompressorParams p;
  p.num_tokens = b.tokens;
  p.ratio = c4a ? 4 : 128;
  p.dim = kKvDim;
  p.proj = b.proj;
  p.proj_ld = b.proj_ld;
  p.a_col = col.a;
  p.ape = ape_.get();
  p.norm = norm_.get();
  p.eps = float(config_.rms_norm_eps);
  p.rope = &rope_;
  p.positions = b.step.positions;
  p.token_run = b.step.token_run;
  p.row_slot = c4a ? b.step.c4a_state_slot : b.step.c128a_state_slot;
  p.entry_slot = c4a ? b.step.c4a_slot : b.step.c128a_slot;
  p.state_table = b.step.table(c4a ? CacheGroup::kC4AState : CacheGroup::kC128AState);
  p.state = b.cache->pages(layer_, CacheKind::kState);
  p.out = b.cache->pages(layer_, CacheKind::kCompressed);
  p.record = EntryFormat::kFp8DsMla;
  p.bf16_rounding = true;
  p.hadamard = false;
  CompressorParams main = p;
  // A decode step: each compressor in one kernel (a CTA writes its token's
  // row and pools it at once). Any other step: its runs (step/step.h:
  // consecutive tokens at consecutive positions, each writing its own state
  // row) let a compressor write its rows and pool its entries in one kernel
  // (compressor_cuda.h).
  const CompressorLaunch mode = b.one_token_per_run ? CompressorLaunch::kOneTokenPerRun : CompressorLaunch::kRuns;
  if (c4a) {  // the index keys first: the scorer waits for them
    p.dim = kIndexDim;
    p.a_col = col.idx_a;
    p.ape = idx_ape_.get();
    p.norm = idx_norm_.get();
    p.state = b.cache->pages(layer_, CacheKind::kIndexState);
    p.out = b.cache->pages(layer_, CacheKind::kIndexKeys);
    p.record = keys_ == IndexKeyFormat::kFp8 ? EntryFormat::kIndexFp8 : EntryFormat::kIndexMxfp4;
    p.hadamard = true;
    compressor_cuda(p, stream, mode);
    lane_mark(b, Lane::kCompress, LanePoint::kIndexKeys);
  }
  compressor_cuda(main, stream, mode);
  lane_mark(b, Lane::kCompress, LanePoint::kCompressed);
}

void CudaLayer::select(StepBuffers& b) {
  if (!idx_wq_b_) return;
  mark(b, 2 * layer_);
  // Heads past the model's nI (the scorer takes 64) read the zero columns
  // the buffers were made with: their terms are +0.
  const int T = b.tokens, nI = std::max(config_.index_n_heads, kScorerHeads);
  idx_wq_b_->forward(b.cq8, b.idx_q, int64_t(nI) * kIndexDim, b.linear(Lane::kMain), b.stream);
  IndexerQueryParams q;
  q.num_tokens = T;
  q.num_heads = nI;
  q.scale_heads = config_.index_n_heads;
  q.real_tokens = b.real_tokens;
  q.q_raw = b.idx_q;
  q.q_ld = int64_t(nI) * kIndexDim;
  q.proj = b.proj + proj_columns(type_).weights;
  q.proj_ld = b.proj_ld;
  q.positions = b.step.positions;
  q.rope = rope_.freqs();
  q.out = b.idx_queries;
  q.out.num_tokens = T;
  lane_wait(b, Lane::kMain, LanePoint::kProj);  // weights_proj's columns
  indexer_queries_cuda(q, b.stream);
  lane_wait(b, Lane::kMain, LanePoint::kIndexKeys);  // this step's index keys
  if (b.short_select)
    b.indexer->run_short(indexer_params(b), b.stream);  // one kernel, no plan
  else
    b.indexer->run_planned(indexer_params(b), b.stream);  // on the step's plan (the backend's prologue)
  mark(b, 2 * layer_ + 1);
}

IndexerSelectParams CudaLayer::indexer_params(const StepBuffers& b) const {
  IndexerSelectParams s;
  s.num_tokens = b.tokens;
  s.real_tokens = b.real_tokens;
  s.positions = b.step.positions;
  s.token_run = b.step.token_run;
  s.c4a_table = b.step.table(CacheGroup::kC4A);
  s.keys = b.cache->pages(layer_, CacheKind::kIndexKeys);
  s.queries = b.idx_queries;
  s.queries.num_tokens = b.tokens;
  s.topk = config_.index_topk;
  s.picks = b.picks;
  s.slots = b.slots;
  s.lengths = b.pick_lengths;
  return s;
}

void CudaLayer::mark(StepBuffers& b, int event) const {
  if (b.indexer_events) record_event(b.indexer_events[event], b.stream, b.capturing);
}

SparseAttentionParams CudaLayer::attention_params(const StepBuffers& b) const {
  const ModelConfig& config = config_;
  const LayerType t = type_;
  const int layer = layer_;
  SparseAttentionParams p;
  p.num_tokens = b.tokens;
  p.num_heads = config.num_heads;
  p.q = b.q;
  p.swa_cache = b.cache->pages(layer, CacheKind::kSwa);
  p.swa = IndexList{b.step.window_indices, b.step.window_lengths, kWindow};
  if (t == LayerType::kC4A) {
    p.extra_cache = b.cache->pages(layer, CacheKind::kCompressed);
    p.extra = IndexList{b.slots, b.c4a_lengths, config.index_topk};
  } else if (t == LayerType::kC128A) {
    p.extra_cache = b.cache->pages(layer, CacheKind::kCompressed);
    p.extra = IndexList{b.step.c128a_indices, b.step.c128a_lengths, b.step.dims.c128a_width};
  }
  p.attn_sink = sink_.get();
  p.softmax_scale = float(1.0 / std::sqrt(double(kKvDim)));
  p.out = b.o;
  return p;
}

void CudaLayer::output_rope_table(const StepBuffers& b) const {
  out_rope_table_cuda(b.step.positions, b.tokens, rope_, b.out_rope_cs[int(type_)], b.stream);
}

void CudaLayer::attend(StepBuffers& b, bool rotate_out) {
  const OutputRope rope{rotate_out ? b.out_rope_cs[int(type_)] : nullptr};
  // The window's and C128A's lists are step metadata; C4A's come from the
  // indexer in this layer. Their records are an earlier step's but those of
  // the step's own tokens, which this layer writes (qkv_norm_rope, the
  // compressor) at the lists' ends.
  const ListsReady ready{true, type_ == LayerType::kC128A, true};
  b.attention->run(attention_params(b), b.stream, int(type_), rope, ready);
}

bool CudaLayer::project_out(StepBuffers& b, bool rotate_out, const ResidualNormParams* then) {
  const int T = b.tokens, H = config_.num_heads;
  if (rotate_out)
    out_inverse_rope_cuda(OutInverseRopeParams{T, H, b.o, int64_t(H) * kKvDim, b.step.positions, &rope_}, b.stream);
  const int64_t u_cols = int64_t(config_.o_groups) * config_.o_lora_rank;
  if (!wo_a_per_group(config_)) {
    wo_a_[0].forward(b.o, int64_t(H) * kKvDim, T, b.u, u_cols, &b.u8, b.linear(Lane::kMain), b.stream);
  } else {
    const int64_t k_g = int64_t(H / config_.o_groups) * kKvDim;
    for (size_t g = 0; g < wo_a_.size(); ++g)
      wo_a_[g].forward(b.o + int64_t(g) * k_g, int64_t(H) * kKvDim, T, b.u + int64_t(g) * config_.o_lora_rank, u_cols,
                       nullptr, b.linear(Lane::kMain), b.stream);
    quantize_act(b.u, u_cols, b.u8, b.stream);
  }
  return wo_b_.forward(b.u8, b.y, config_.hidden_size, b.linear(Lane::kMain), b.stream, LinearTail{.residual = then});
}

// Reads back what the golden replay compares, after the attention and
// before the output's inverse RoPE (in place on o): q, the attention output,
// the step's new cache entries and (C4A) index keys and picks.
void CudaLayer::read_back(const StepBuffers& b, LayerCapture& capture) const {
  check(cudaStreamSynchronize(b.stream), "capture");
  const int real = real_tokens(b), H = config_.num_heads;
  capture.q = download_bf16(b.q, real, int64_t(H) * kKvDim, int64_t(H) * kKvDim);
  capture.attn = download_bf16(b.o, real, int64_t(H) * kKvDim, int64_t(H) * kKvDim);
  const std::vector<int32_t> swa = download_ints(b.step.swa_slot, real);
  capture.kv.assign(size_t(real) * kKvDim, 0.0f);
  const KvPagesMut swa_pages = b.cache->pages(layer_, CacheKind::kSwa);
  for (int t = 0; t < real; ++t)
    if (swa[size_t(t)] >= 0)
      read_device_entry(swa_pages, EntryFormat::kFp8DsMla, kKvDim, swa[size_t(t)],
                        capture.kv.data() + size_t(t) * kKvDim);
  if (type_ != LayerType::kSwaOnly) {
    const bool c4a = type_ == LayerType::kC4A;
    const std::vector<int32_t> slots = download_ints(c4a ? b.step.c4a_slot : b.step.c128a_slot, real);
    capture_entries(slots, real, b.cache->pages(layer_, CacheKind::kCompressed), EntryFormat::kFp8DsMla, kKvDim,
                    capture.compressed_tokens, capture.compressed);
    if (c4a) {
      const EntryFormat kf = keys_ == IndexKeyFormat::kFp8 ? EntryFormat::kIndexFp8 : EntryFormat::kIndexMxfp4;
      capture_entries(slots, real, b.cache->pages(layer_, CacheKind::kIndexKeys), kf, kIndexDim,
                      capture.index_key_tokens, capture.index_keys);
      const int k = config_.index_topk;
      const std::vector<int32_t> picks = download_ints(b.picks, int64_t(real) * k);
      const std::vector<int32_t> lengths = download_ints(b.pick_lengths, real);
      capture.topk.assign(size_t(real), {});
      for (int t = 0; t < real; ++t)
        capture.topk[size_t(t)].assign(picks.begin() + int64_t(t) * k, picks.begin() + int64_t(t) * k + lengths[size_t(t)]);
    }
  }
}

bool CudaLayer::forward(StepBuffers& b, LayerCapture* capture, const ResidualNormParams* then) {
  if (b.tokens == 0) return false;
  compress(b);      // compressor lane
  project_q_kv(b);  // main lane, q's heads on theirs
  select(b);
  // Attention reads q, the compressed entries and (C4A) the picks.
  if (proj_) lane_wait(b, Lane::kMain, LanePoint::kCompressed);
  if (heads_lane() != Lane::kMain) lane_wait(b, Lane::kMain, LanePoint::kHeads);
  // The output's inverse RoPE is fused into the attention's output writes,
  // except when the golden replay reads o back before it (then its own kernel).
  attend(b, /*rotate_out=*/capture == nullptr);
  if (capture) read_back(b, *capture);
  return project_out(b, /*rotate_out=*/capture != nullptr, then);
}

}  // namespace dsv4::cuda
