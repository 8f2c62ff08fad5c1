#pragma once
// Views of paged cache storage (SPEC §6), on the host or on a device: what
// kernels and CPU ops read and write. Page p of an arena starts at
// base + p * page_stride; entry t of page p has the global slot
// p * entries_per_page + t. Byte offsets are 64-bit (page index x stride
// passes 2^31 at about 57K fp8_ds_mla pages).
#include <cstddef>
#include <cstdint>

namespace dsv4 {

// Read-only view of one paged cache.
struct KvPages {
  const uint8_t* base = nullptr;
  int64_t num_pages = 0;
  int entries_per_page = 64;
  size_t page_stride = 0;  // bytes

  constexpr int64_t capacity() const { return num_pages * entries_per_page; }
  constexpr const uint8_t* page(int64_t p) const { return base + size_t(p) * page_stride; }
};

// The same view with write access (cache inserts: SWA, compressed entries,
// indexer keys, compressor state rows).
struct KvPagesMut {
  uint8_t* base = nullptr;
  int64_t num_pages = 0;
  int entries_per_page = 64;
  size_t page_stride = 0;

  constexpr int64_t capacity() const { return num_pages * entries_per_page; }
  constexpr uint8_t* page(int64_t p) const { return base + size_t(p) * page_stride; }
  constexpr operator KvPages() const { return KvPages{base, num_pages, entries_per_page, page_stride}; }
};

}  // namespace dsv4
