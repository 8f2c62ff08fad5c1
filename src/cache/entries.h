#pragma once
// Entries of a paged arena, read and written as floats through the byte
// format of SPEC §6 (fp8_ds_mla, FP8/MXFP4 indexer keys) or float32 (the exact
// profile's caches, compressor state rows). Host pointers.
#include <cstdint>

#include "cache/cache_spec.h"
#include "cache/pages.h"

namespace dsv4 {

struct EntryArena {
  KvPagesMut pages;
  EntryFormat format = EntryFormat::kF32;
  int dim = 0;  // floats per entry

  bool empty() const { return pages.base == nullptr; }
  // Slot = page * entries_per_page + offset (SPEC §6); byte offsets are 64-bit.
  void write(int64_t slot, const float* v) const;
  void read(int64_t slot, float* v) const;
};

}  // namespace dsv4
