#pragma once
// The fp8_ds_mla page of SPEC §6 (byte-compatible with FlashMLA's V4 "MODEL1"
// layout), used by the SWA cache and the main compressed caches.
//
// A page of B entries: bytes [0, 576*B) hold entry t at 576*t: 448 e4m3 bytes
// (dims 0..447) then 64 little-endian bf16 (dims 448..511). Bytes
// [576*B, 584*B) hold entry t's scales at 576*B + 8*t: seven UE8M0 bytes (one
// per 64-dim block) and a pad byte. The page stride is 584*B rounded up to a
// multiple of 576.
#include <cstddef>
#include <cstdint>

namespace dsv4 {

inline constexpr int kKvDim = 512;
inline constexpr int kNopeDim = 448;
inline constexpr int kKvScaleBlocks = kNopeDim / 64;     // 7
inline constexpr int kKvEntryDataBytes = kNopeDim + 128;  // 576
inline constexpr int kKvEntryScaleBytes = 8;
inline constexpr int kKvEntryBytes = kKvEntryDataBytes + kKvEntryScaleBytes;  // 584

constexpr size_t fp8_ds_mla_page_stride(int entries_per_page) {
  const size_t raw = size_t(kKvEntryBytes) * size_t(entries_per_page);
  return (raw + kKvEntryDataBytes - 1) / kKvEntryDataBytes * kKvEntryDataBytes;
}

// Byte offsets of entry t inside its page.
constexpr size_t fp8_ds_mla_data_offset(int t) { return size_t(kKvEntryDataBytes) * size_t(t); }
constexpr size_t fp8_ds_mla_scale_offset(int entries_per_page, int t) {
  return size_t(kKvEntryDataBytes) * size_t(entries_per_page) + size_t(kKvEntryScaleBytes) * size_t(t);
}

// Quantizes one 512-dim vector (SPEC §5 KV FP8) into entry t of a page.
void fp8_ds_mla_encode(const float* kv, uint8_t* page, int entries_per_page, int t);
// Reads entry t of a page back as floats: bf16(e4m3) * scale, and the bf16 tail.
void fp8_ds_mla_decode(const uint8_t* page, int entries_per_page, int t, float* kv);

// What a cache round trip does to a vector, without a page: the FP8 rounding
// of dims 0..447 and bf16 rounding of dims 448..511.
void fp8_ds_mla_round_trip(float* kv);

}  // namespace dsv4
