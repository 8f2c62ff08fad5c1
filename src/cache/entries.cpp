#include "cache/entries.h"

#include <cstring>

#include "cache/fp8_ds_mla.h"
#include "cache/index_key_format.h"

namespace dsv4 {

void EntryArena::write(int64_t slot, const float* v) const {
  uint8_t* page = pages.page(slot / pages.entries_per_page);
  const int t = int(slot % pages.entries_per_page), b = pages.entries_per_page;
  switch (format) {
    case EntryFormat::kFp8DsMla: fp8_ds_mla_encode(v, page, b, t); return;
    case EntryFormat::kIndexFp8: index_key_encode(IndexKeyFormat::kFp8, v, page, b, t); return;
    case EntryFormat::kIndexMxfp4: index_key_encode(IndexKeyFormat::kMxfp4, v, page, b, t); return;
    case EntryFormat::kF32: std::memcpy(page + sizeof(float) * size_t(dim) * size_t(t), v, sizeof(float) * size_t(dim)); return;
  }
}

void EntryArena::read(int64_t slot, float* v) const {
  const uint8_t* page = pages.page(slot / pages.entries_per_page);
  const int t = int(slot % pages.entries_per_page), b = pages.entries_per_page;
  switch (format) {
    case EntryFormat::kFp8DsMla: fp8_ds_mla_decode(page, b, t, v); return;
    case EntryFormat::kIndexFp8: index_key_decode(IndexKeyFormat::kFp8, page, b, t, v); return;
    case EntryFormat::kIndexMxfp4: index_key_decode(IndexKeyFormat::kMxfp4, page, b, t, v); return;
    case EntryFormat::kF32: std::memcpy(v, page + sizeof(float) * size_t(dim) * size_t(t), sizeof(float) * size_t(dim)); return;
  }
}

}  // namespace dsv4
