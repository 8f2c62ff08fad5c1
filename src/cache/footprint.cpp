#include "cache/footprint.h"

#include "cache/cache_spec.h"
#include "cache/fp8_ds_mla.h"

namespace dsv4 {

namespace {
constexpr double kTokensPerCompressedPage = 256;  // main and indexer caches: one page per 256 raw tokens

}  // namespace

CacheFootprint layer_footprint(LayerType t, IndexKeyFormat keys) {
  CacheFootprint f;
  f.fixed_bytes = double(kWindow) * kKvEntryBytes;  // the SWA window every layer keeps
  if (t == LayerType::kSwaOnly) return f;
  const int m = compress_ratio(t);
  const int entries_per_page = int(kTokensPerCompressedPage) / m;
  f.bytes_per_token = double(kKvEntryBytes) / m;
  f.paged_bytes_per_token = double(fp8_ds_mla_page_stride(entries_per_page)) / kTokensPerCompressedPage;
  // Compressor state: the fp32 rows [a | g + ape] of the tokens a block still needs.
  const int coff = t == LayerType::kC4A ? 2 : 1;
  const int rows = t == LayerType::kC4A ? 8 : 128;
  f.fixed_bytes += double(rows) * 2 * coff * kKvDim * sizeof(float);
  if (t == LayerType::kC4A) {
    f.bytes_per_token += double(index_key_entry_bytes(keys)) / m;
    f.paged_bytes_per_token += double(index_key_page_stride(keys, entries_per_page)) / kTokensPerCompressedPage;
    f.fixed_bytes += 8.0 * 2 * 2 * kIndexDim * sizeof(float);  // the indexer compressor's rows
  }
  return f;
}

CacheFootprint stack_footprint(const ModelConfig& config, IndexKeyFormat keys) {
  CacheFootprint total;
  for (int i = 0; i < config.num_layers; ++i) {
    const CacheFootprint f = layer_footprint(config.layer_type(i), keys);
    total.bytes_per_token += f.bytes_per_token;
    total.paged_bytes_per_token += f.paged_bytes_per_token;
    total.fixed_bytes += f.fixed_bytes;
  }
  return total;
}

double dense_mla_bytes_per_token(const ModelConfig& config) { return double(config.num_layers) * kKvEntryBytes; }

}  // namespace dsv4
