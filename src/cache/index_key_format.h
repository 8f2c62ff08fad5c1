#pragma once
// Indexer key pages of SPEC §6 (C4A layers), two formats. Keys are 128-dim and
// already Hadamard-rotated when they reach these codecs.
//  - FP8: 132 bytes per entry. A data plane of 128 e4m3 bytes per entry, then
//    a plane of one float32 scale per entry (one power-of-two scale per key).
//  - MXFP4: 68 bytes per entry. 64 bytes of packed e2m1 per entry (element 2i
//    in the low nibble), then 4 UE8M0 bytes per entry (one per 32 dims).
#include <cstddef>
#include <cstdint>
#include <string_view>

namespace dsv4 {

inline constexpr int kIndexDim = 128;

enum class IndexKeyFormat { kFp8, kMxfp4 };

std::string_view index_key_format_name(IndexKeyFormat f);
// Parses "fp8" or "mxfp4"; throws Error naming the value otherwise.
IndexKeyFormat parse_index_key_format(std::string_view name);

constexpr int index_key_entry_bytes(IndexKeyFormat f) { return f == IndexKeyFormat::kFp8 ? 132 : 68; }
constexpr size_t index_key_page_stride(IndexKeyFormat f, int entries_per_page) {
  return size_t(index_key_entry_bytes(f)) * size_t(entries_per_page);
}

void index_key_encode(IndexKeyFormat f, const float* key, uint8_t* page, int entries_per_page, int t);
void index_key_decode(IndexKeyFormat f, const uint8_t* page, int entries_per_page, int t, float* key);


}  // namespace dsv4
