#include "attn/layer.h"

#include <cmath>
#include <unordered_map>

#include "attn/cpu/attend.h"
#include "cache/fp8_ds_mla.h"
#include "common/error.h"
#include "numerics/bf16.h"
#include "numerics/rmsnorm.h"

namespace dsv4 {

AttentionLayer::AttentionLayer(const ModelConfig& config, const LayerWeights& weights, const LayerCaches& caches,
                               const LayerOptions& options)
    : config_(config), w_(weights), caches_(caches), opt_(options), type_(weights.type),
      rope_(config.rope_params(weights.type)),
      wq_a_(&weights.wq_a, LinearMode::kFp8, options.cache_weights),
      wq_b_(&weights.wq_b, LinearMode::kFp8, options.cache_weights),
      wkv_(&weights.wkv, LinearMode::kFp8, options.cache_weights),
      wo_b_(&weights.wo_b, LinearMode::kFp8, options.cache_weights) {
  require(type_ == config.layer_type(weights.layer), "layer " + std::to_string(weights.layer) +
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

void AttentionLayer::project_q(const StepMetadata& s, const float* x, std::vector<float>& cq,
                               std::vector<float>& q) const {
  const int T = s.num_tokens(), H = config_.num_heads, R = config_.q_lora_rank;
  const bool prod = opt_.profile == Profile::kProduction;
  const float eps = float(config_.rms_norm_eps);
  cq.resize(size_t(T) * R);
  q.resize(size_t(T) * H * kKvDim);
  wq_a_.forward(x, T, cq.data(), opt_.profile);
#pragma omp parallel for
  for (int t = 0; t < T; ++t) {
    float* c = cq.data() + size_t(t) * R;
    rms_norm(c, w_.q_norm.data(), R, eps, c);
    if (prod) round_bf16(c, size_t(R));
  }
  wq_b_.forward(cq.data(), T, q.data(), opt_.profile);
#pragma omp parallel for
  for (int t = 0; t < T; ++t) {
    for (int h = 0; h < H; ++h) {
      float* qh = q.data() + (size_t(t) * H + h) * kKvDim;
      if (prod) rms_norm_bf16_arith(qh, kKvDim, eps);
      else rms_norm(qh, nullptr, kKvDim, eps, qh);
      rope_.apply(qh + kNopeDim, s.positions[size_t(t)]);
      if (prod) round_bf16(qh + kNopeDim, kRopeDim);
    }
  }
}

void AttentionLayer::insert_kv(const StepMetadata& s, const float* x, LayerCapture* capture) const {
  const int T = s.num_tokens();
  const bool prod = opt_.profile == Profile::kProduction;
  std::vector<float> kv(size_t(T) * kKvDim);
  wkv_.forward(x, T, kv.data(), opt_.profile);
  if (capture) capture->kv.resize(kv.size());
#pragma omp parallel for
  for (int t = 0; t < T; ++t) {
    float* v = kv.data() + size_t(t) * kKvDim;
    rms_norm(v, w_.kv_norm.data(), kKvDim, float(config_.rms_norm_eps), v);
    if (prod) round_bf16(v, kKvDim);
    rope_.apply(v + kNopeDim, s.positions[size_t(t)]);
    if (prod) round_bf16(v + kNopeDim, kRopeDim);
    caches_.swa->write(s.swa_slot[size_t(t)], v);  // FP8-quantized here in production
    if (capture) caches_.swa->read(s.swa_slot[size_t(t)], capture->kv.data() + size_t(t) * kKvDim);
  }
}

namespace {

// Appends the cached entries a compressor completed to a capture.
void capture_entries(const std::vector<int>& tokens, const std::vector<int32_t>& slots, const PageStore& store,
                     std::vector<int>& out_tokens, std::vector<float>& out) {
  for (int t : tokens) {
    out_tokens.push_back(t);
    out.resize(out.size() + size_t(store.dim()));
    store.read(slots[size_t(t)], out.data() + out.size() - size_t(store.dim()));
  }
}

}  // namespace

void AttentionLayer::compress(const StepMetadata& s, const float* x, LayerCapture* capture) const {
  if (!compressor_) return;
  const bool c4a = type_ == LayerType::kC4A;
  CompressorIo io;
  io.state_group = c4a ? CacheGroup::kC4AState : CacheGroup::kC128AState;
  io.state_slots = c4a ? &s.c4a_state_slot : &s.c128a_state_slot;
  io.state_tables = c4a ? &s.c4a_state_table : &s.c128a_state_table;
  io.out_slots = c4a ? &s.c4a_slot : &s.c128a_slot;
  io.state = caches_.state;
  io.out = caches_.compressed;
  const std::vector<int> done = compressor_->forward(s, x, io);
  if (capture) capture_entries(done, *io.out_slots, *io.out, capture->compressed_tokens, capture->compressed);
  if (!index_compressor_) return;
  io.state = caches_.index_state;
  io.out = caches_.index_keys;
  const std::vector<int> keys_done = index_compressor_->forward(s, x, io);
  if (capture) capture_entries(keys_done, *io.out_slots, *io.out, capture->index_key_tokens, capture->index_keys);
}

namespace {

// Decoded cache entries of one run, each read once however many of the run's
// tokens attend it (a prefill chunk's windows overlap almost entirely).
class EntryRows {
 public:
  explicit EntryRows(const PageStore* store) : store_(store) {}
  void add(int32_t slot) {
    if (row_of_.try_emplace(slot, slots_.size()).second) slots_.push_back(slot);
  }
  void decode() {
    rows_.resize(slots_.size() * kKvDim);
#pragma omp parallel for
    for (size_t i = 0; i < slots_.size(); ++i) store_->read(slots_[i], rows_.data() + i * kKvDim);
  }
  const float* row(int32_t slot) const { return rows_.data() + row_of_.at(slot) * kKvDim; }

 private:
  const PageStore* store_;
  std::unordered_map<int32_t, size_t> row_of_;
  std::vector<int32_t> slots_;
  std::vector<float> rows_;
};

}  // namespace

void AttentionLayer::attend(const StepMetadata& s, const std::vector<float>& q,
                            const std::vector<std::vector<int32_t>>& picks, std::vector<float>& o) const {
  const int H = config_.num_heads;
  const AttendOptions opt{float(1.0 / std::sqrt(double(kKvDim))), opt_.profile == Profile::kProduction};
  o.resize(size_t(s.num_tokens()) * H * kKvDim);
  for (size_t r = 0; r < s.runs.size(); ++r) {
    // Decode every entry the run's tokens read, once, before attending.
    EntryRows window(caches_.swa), compressed(caches_.compressed);
    std::vector<std::vector<int32_t>> comp_slots(size_t(s.token_begin[r + 1] - s.token_begin[r]));
    for (int t = s.token_begin[r]; t < s.token_begin[r + 1]; ++t) {
      auto& slots = comp_slots[size_t(t - s.token_begin[r])];
      if (type_ == LayerType::kC4A) {
        for (int32_t j : picks[size_t(t)]) slots.push_back(StepMetadata::map_slot(s.c4a_table[r], CacheGroup::kC4A, j));
      } else if (type_ == LayerType::kC128A) {
        const int32_t* list = s.c128a_indices.data() + size_t(t) * size_t(s.c128a_width);
        slots.assign(list, list + s.c128a_lengths[size_t(t)]);
      }
      for (int i = 0; i < s.window_lengths[size_t(t)]; ++i) window.add(s.window_indices[size_t(t) * kWindow + i]);
      for (int32_t slot : slots) compressed.add(slot);
    }
    window.decode();
    compressed.decode();
#pragma omp parallel
    {
      std::vector<float> keys, scratch;
#pragma omp for schedule(dynamic)
      for (int t = s.token_begin[r]; t < s.token_begin[r + 1]; ++t) {
        keys.clear();
        auto add = [&](const float* row) { keys.insert(keys.end(), row, row + kKvDim); };
        for (int i = 0; i < s.window_lengths[size_t(t)]; ++i) add(window.row(s.window_indices[size_t(t) * kWindow + i]));
        for (int32_t slot : comp_slots[size_t(t - s.token_begin[r])]) add(compressed.row(slot));
        const int n = int(keys.size() / kKvDim);
        scratch.resize(size_t(H) * size_t(std::max(n, 1)));
        float* ot = o.data() + size_t(t) * H * kKvDim;
        attend_heads(q.data() + size_t(t) * H * kKvDim, H, keys.data(), n, w_.attn_sink.data(), opt, ot, nullptr,
                     scratch.data());
        if (opt.bf16_probs) round_bf16(ot, size_t(H) * kKvDim);
      }
    }
  }
}

void AttentionLayer::project_out(const StepMetadata& s, std::vector<float>& o, float* y) const {
  const int T = s.num_tokens(), H = config_.num_heads, G = config_.o_groups, r = config_.o_lora_rank;
  const bool prod = opt_.profile == Profile::kProduction;
#pragma omp parallel for
  for (int t = 0; t < T; ++t) {
    for (int h = 0; h < H; ++h) {
      float* oh = o.data() + (size_t(t) * H + h) * kKvDim + kNopeDim;
      rope_.apply(oh, s.positions[size_t(t)], true);
      if (prod) round_bf16(oh, kRopeDim);
    }
  }
  // Group g's heads are contiguous: its input is a [T, H/G * 512] column block of o.
  const int group_in = H / G * kKvDim;
  std::vector<float> u(size_t(T) * G * r);
  for (int g = 0; g < G; ++g)
    wo_a_[size_t(g)].forward(o.data() + size_t(g) * group_in, H * kKvDim, T, u.data() + size_t(g) * r, G * r,
                             opt_.profile);
  wo_b_.forward(u.data(), T, y, opt_.profile);
}

void AttentionLayer::forward(const StepMetadata& s, const float* x, float* y, LayerCapture* capture) const {
  if (s.num_tokens() == 0) return;
  std::vector<float> cq, q, o;
  project_q(s, x, cq, q);
  insert_kv(s, x, capture);
  compress(s, x, capture);
  std::vector<std::vector<int32_t>> picks;
  if (indexer_) picks = indexer_->select(s, x, cq.data(), *caches_.index_keys);
  attend(s, q, picks, o);
  if (capture) {
    capture->q = q;
    capture->topk = picks;
    capture->attn = o;
  }
  project_out(s, o, y);
}

}  // namespace dsv4
