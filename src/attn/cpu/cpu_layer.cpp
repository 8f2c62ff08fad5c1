#include "attn/cpu/cpu_layer.h"

#include <algorithm>
#include <cmath>

#include "attn/cpu/sparse_attention_cpu.h"
#include "cache/fp8_ds_mla.h"
#include "common/error.h"
#include "numerics/bf16.h"
#include "numerics/rmsnorm.h"

namespace dsv4 {

CpuLayer::CpuLayer(const ModelConfig& config, const LayerWeights& weights, const BackendOptions& options)
    : config_(config), w_(weights), opt_(options), type_(weights.type), rope_(config.rope_params(weights.type)),
      wq_a_(&weights.wq_a, LinearMode::kFp8, options.cache_weights),
      wq_b_(&weights.wq_b, LinearMode::kFp8, options.cache_weights),
      wkv_(&weights.wkv, LinearMode::kFp8, options.cache_weights),
      wo_b_(&weights.wo_b, LinearMode::kFp8, options.cache_weights) {
  DSV4_REQUIRE(type_ == config.layer_type(weights.layer), "layer " + std::to_string(weights.layer) +
                                                         ": weights are for a different layer type than the config");
  // wo_a runs as a bf16 product on its dequantized weight, one group at a time.
  for (int g = 0; g < config.o_groups; ++g)
    wo_a_.emplace_back(&weights.wo_a, LinearMode::kBf16, options.cache_weights, int64_t(g) * config.o_lora_rank,
                       config.o_lora_rank);
  const float eps = float(config.rms_norm_eps);
  if (weights.compressor)
    compressor_ = std::make_unique<CompressorOp>(*weights.compressor, options.profile, options.cache_weights, rope_,
                                                 eps, false);
  if (weights.indexer) {
    index_compressor_ = std::make_unique<CompressorOp>(weights.indexer->compressor, options.profile,
                                                       options.cache_weights, rope_, eps, true);
    indexer_ = std::make_unique<IndexerOp>(*weights.indexer, config, options.profile, options.cache_weights, rope_,
                                           options.index_keys, options.indexer_key_tile);
  }
}

int64_t CpuLayer::weight_copy_bytes() const {
  int64_t b = wq_a_.copy_bytes() + wq_b_.copy_bytes() + wkv_.copy_bytes() + wo_b_.copy_bytes();
  for (const Linear& l : wo_a_) b += l.copy_bytes();
  if (compressor_) b += compressor_->copy_bytes();
  if (index_compressor_) b += index_compressor_->copy_bytes() + indexer_->copy_bytes();
  return b;
}

void CpuLayer::project_q(const StepView& s, const float* x, CpuScratch& ws) const {
  const int T = s.dims.tokens, H = config_.num_heads, R = config_.q_lora_rank;
  const bool prod = opt_.profile == Profile::kProduction;
  const float eps = float(config_.rms_norm_eps);
  float* cq = sized(ws.cq, size_t(T) * R);
  float* q = sized(ws.q, size_t(T) * H * kKvDim);
  wq_a_.forward(x, T, cq, opt_.profile, &ws.xq);
#pragma omp parallel for
  for (int t = 0; t < T; ++t) {
    float* c = cq + size_t(t) * R;
    rms_norm(c, w_.q_norm.data(), R, eps, c);
    if (prod) round_bf16(c, size_t(R));
  }
  wq_b_.forward(cq, T, q, opt_.profile, &ws.xq);
#pragma omp parallel for
  for (int t = 0; t < T; ++t) {
    for (int h = 0; h < H; ++h) {
      float* qh = q + (size_t(t) * H + h) * kKvDim;
      if (prod) rms_norm_bf16_arith(qh, kKvDim, eps);
      else rms_norm(qh, nullptr, kKvDim, eps, qh);
      rope_.apply(qh + kNopeDim, s.positions[t]);
      if (prod) round_bf16(qh + kNopeDim, kRopeDim);
    }
  }
}

void CpuLayer::insert_kv(const StepView& s, const LayerCaches& c, const float* x, CpuScratch& ws,
                         LayerCapture* capture) const {
  const int T = s.dims.tokens;
  const bool prod = opt_.profile == Profile::kProduction;
  float* kv = sized(ws.kv, size_t(T) * kKvDim);
  wkv_.forward(x, T, kv, opt_.profile, &ws.xq);
  if (capture) capture->kv.assign(size_t(T) * kKvDim, 0.0f);
#pragma omp parallel for
  for (int t = 0; t < T; ++t) {
    float* v = kv + size_t(t) * kKvDim;
    rms_norm(v, w_.kv_norm.data(), kKvDim, float(config_.rms_norm_eps), v);
    if (prod) round_bf16(v, kKvDim);
    rope_.apply(v + kNopeDim, s.positions[t]);
    if (prod) round_bf16(v + kNopeDim, kRopeDim);
    if (s.swa_slot[t] < 0) continue;
    c.swa.write(s.swa_slot[t], v);  // FP8-quantized here in production
    if (capture) c.swa.read(s.swa_slot[t], capture->kv.data() + size_t(t) * kKvDim);
  }
}

namespace {

// Appends the cached entries a compressor completed to a capture.
void capture_entries(const std::vector<int>& tokens, const int32_t* slots, const EntryArena& arena,
                     std::vector<int>& out_tokens, std::vector<float>& out) {
  for (int t : tokens) {
    out_tokens.push_back(t);
    out.resize(out.size() + size_t(arena.dim));
    arena.read(slots[t], out.data() + out.size() - size_t(arena.dim));
  }
}

}  // namespace

void CpuLayer::compress(const StepView& s, const LayerCaches& c, const float* x, CpuScratch& ws,
                        LayerCapture* capture) const {
  if (!compressor_) return;
  const bool c4a = type_ == LayerType::kC4A;
  CompressorIo io;
  io.state_table = s.table(c4a ? CacheGroup::kC4AState : CacheGroup::kC128AState);
  io.state_slots = c4a ? s.c4a_state_slot : s.c128a_state_slot;
  io.out_slots = c4a ? s.c4a_slot : s.c128a_slot;
  io.state = c.state;
  io.out = c.compressed;
  const std::vector<int> done = compressor_->forward(s, x, io, ws);
  if (capture) capture_entries(done, io.out_slots, io.out, capture->compressed_tokens, capture->compressed);
  if (!index_compressor_) return;
  io.state = c.index_state;
  io.out = c.index_keys;
  const std::vector<int> keys_done = index_compressor_->forward(s, x, io, ws);
  if (capture) capture_entries(keys_done, io.out_slots, io.out, capture->index_key_tokens, capture->index_keys);
}

int CpuLayer::extra_list(const StepView& s, const std::vector<std::vector<int32_t>>& picks,
                         std::vector<int32_t>& indices, std::vector<int32_t>& lengths) const {
  const int T = s.dims.tokens;
  if (type_ == LayerType::kC128A) {
    indices.assign(s.c128a_indices, s.c128a_indices + size_t(T) * size_t(s.dims.c128a_width));
    lengths.assign(s.c128a_lengths, s.c128a_lengths + T);
    return s.dims.c128a_width;
  }
  if (type_ != LayerType::kC4A) return 0;
  // The indexer's request-local picks, mapped to global slots: the flat
  // [T, topk] list the kernels read.
  const int k = config_.index_topk;
  indices.assign(size_t(T) * size_t(k), -1);
  lengths.assign(size_t(T), 0);
  for (int t = 0; t < T; ++t) {
    const auto& p = picks[size_t(t)];
    lengths[size_t(t)] = int32_t(p.size());
    for (size_t i = 0; i < p.size(); ++i)
      indices[size_t(t) * size_t(k) + i] = block_table_slot(s.table(CacheGroup::kC4A), s.token_run[t], p[i]);
  }
  return k;
}

void CpuLayer::attend(const StepView& s, const LayerCaches& c, const std::vector<std::vector<int32_t>>& picks,
                      CpuScratch& ws) const {
  const int T = s.dims.tokens, H = config_.num_heads;
  std::vector<int32_t> extra_indices, extra_lengths;
  SparseAttentionParams p;
  p.num_tokens = T;
  p.num_heads = H;
  p.swa_cache = c.swa.pages;
  p.swa = IndexList{s.window_indices, s.window_lengths, kWindow};
  p.extra = IndexList{nullptr, nullptr, extra_list(s, picks, extra_indices, extra_lengths)};
  if (p.extra.width > 0) {
    p.extra_cache = c.compressed.pages;
    p.extra.indices = extra_indices.data();
    p.extra.lengths = extra_lengths.data();
  }
  p.attn_sink = w_.attn_sink.data();
  p.softmax_scale = float(1.0 / std::sqrt(double(kKvDim)));
  const size_t n = size_t(T) * H * kKvDim;
  const float* q = ws.q.data();
  float* o = sized(ws.o, n);
  if (opt_.profile == Profile::kExact) {
    sparse_attention_exact_cpu(p, q, o);
    return;
  }
  // Production: q and o are bf16 values; the kernel interface carries their bits.
  uint16_t* qb = sized(ws.q_bits, n);
  uint16_t* ob = sized(ws.o_bits, n);
  for (size_t i = 0; i < n; ++i) qb[i] = bf16_bits(q[i]);
  p.q = qb;
  p.out = ob;
  sparse_attention_cpu(p);
  for (size_t i = 0; i < n; ++i) o[i] = bf16_to_float(ob[i]);
}

void CpuLayer::project_out(const StepView& s, CpuScratch& ws, float* y) const {
  const int T = s.dims.tokens, H = config_.num_heads, G = config_.o_groups, r = config_.o_lora_rank;
  const bool prod = opt_.profile == Profile::kProduction;
#pragma omp parallel for
  for (int t = 0; t < T; ++t) {
    for (int h = 0; h < H; ++h) {
      float* oh = ws.o.data() + (size_t(t) * H + h) * kKvDim + kNopeDim;
      rope_.apply(oh, s.positions[t], true);
      if (prod) round_bf16(oh, kRopeDim);
    }
  }
  // Group g's heads are contiguous: its input is a [T, H/G * 512] column block of o.
  const int group_in = H / G * kKvDim;
  float* u = sized(ws.u, size_t(T) * G * r);
  for (int g = 0; g < G; ++g)
    wo_a_[size_t(g)].forward(ws.o.data() + size_t(g) * group_in, H * kKvDim, T, u + size_t(g) * r, G * r,
                             opt_.profile);
  wo_b_.forward(u, T, y, opt_.profile, &ws.xq);
}

void CpuLayer::forward(const StepView& s, const LayerCaches& c, const float* x, float* y, CpuScratch& ws,
                       LayerCapture* capture) const {
  if (s.dims.tokens == 0) return;
  project_q(s, x, ws);
  insert_kv(s, c, x, ws, capture);
  compress(s, c, x, ws, capture);
  std::vector<std::vector<int32_t>> picks;
  if (indexer_) picks = indexer_->select(s, x, ws.cq.data(), c.index_keys, ws);
  attend(s, c, picks, ws);
  if (capture) {
    capture->q = ws.q;  // sized to this step
    capture->topk = picks;
    capture->attn = ws.o;
  }
  project_out(s, ws, y);
}

}  // namespace dsv4
