#pragma once
// Random valid cache contents, for benchmarks that measure decode at a long
// context without prefilling it (issue #12 allows it; say so where used):
// every byte of a page is a function of (seed, arena, page, offset) that
// produces valid records of the arena's format — e4m3 codes without NaN,
// power-of-two scales of plausible size (activations after an RMSNorm are
// O(1)), bf16 RoPE dims, finite float32 state rows. Host and device share it.
#include <bit>
#include <cstddef>
#include <cstdint>

#include "cache/cache_spec.h"
#include "cache/fp8_ds_mla.h"
#include "cache/index_key_format.h"
#include "numerics/bf16.h"

namespace dsv4 {

constexpr uint64_t synthetic_hash(uint64_t x) {
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdull;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ull;
  return x ^ (x >> 33);
}

// A float in [-2, 2) from a hash (a few bits of mantissa: plausible values).
constexpr float synthetic_value(uint64_t h) { return float(int64_t(h % 4096) - 2048) / 1024.0f; }

// An e4m3 code that is not NaN.
constexpr uint8_t synthetic_e4m3(uint64_t h) {
  const uint8_t c = uint8_t(h & 0xff);
  return (c & 0x7f) == 0x7f ? uint8_t(c ^ 1) : c;
}

// Byte `off` (< page stride) of page `page` of an arena with this format.
// Multi-byte fields are produced whole by the byte that starts them and
// byte-sliced for the others, so any order of filling gives the same page.
constexpr uint8_t synthetic_cache_byte(EntryFormat f, int entries_per_page, uint64_t seed, int64_t page, size_t off) {
  const uint64_t B = uint64_t(entries_per_page);
  auto h = [&](uint64_t field) { return synthetic_hash(seed ^ synthetic_hash(uint64_t(page) * 0x9e3779b97f4a7c15ull + field)); };
  switch (f) {
    case EntryFormat::kFp8DsMla: {
      const uint64_t data = uint64_t(kKvEntryDataBytes) * B;
      if (off < data) {
        const uint64_t in = off % kKvEntryDataBytes;
        if (in < uint64_t(kNopeDim)) return synthetic_e4m3(h(off));
        const uint64_t pair = off - (in - kNopeDim) % 2;  // the bf16's first byte
        const uint16_t bits = bf16_bits(synthetic_value(h(pair)));
        return uint8_t(off == pair ? bits & 0xff : bits >> 8);
      }
      const uint64_t s = (off - data) % kKvEntryScaleBytes;
      if (off >= data + uint64_t(kKvEntryScaleBytes) * B || s == kKvScaleBlocks) return 0;  // pad
      return uint8_t(118 + h(off) % 5);  // 2^-9 .. 2^-5: values up to ~14
    }
    case EntryFormat::kIndexFp8: {
      const uint64_t data = uint64_t(kIndexDim) * B;
      if (off < data) return synthetic_e4m3(h(off));
      const uint64_t first = off - (off - data) % 4;
      const float scale = 0x1p-8f * float(1 << (h(first) % 3));
      const uint32_t bits = std::bit_cast<uint32_t>(scale);
      return uint8_t(bits >> (8 * (off - first)));
    }
    case EntryFormat::kIndexMxfp4: {
      const uint64_t data = uint64_t(kIndexDim / 2) * B;
      if (off < data) return uint8_t(h(off) & 0xff);
      return uint8_t(124 + h(off) % 3);  // 2^-3 .. 2^-1
    }
    case EntryFormat::kF32: {
      const uint64_t first = off - off % 4;
      const uint32_t bits = std::bit_cast<uint32_t>(synthetic_value(h(first)));
      return uint8_t(bits >> (8 * (off - first)));
    }
  }
  return 0;
}

}  // namespace dsv4
