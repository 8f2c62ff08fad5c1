#pragma once
// One layer's pages of one cache: num_pages * page_stride bytes, entries laid
// out by an EntryCodec. Page ids come from the BlockPool of the cache's group.
#include <cstddef>
#include <cstdint>
#include <vector>

#include "cache/entry_codec.h"

namespace dsv4 {

class PageStore {
 public:
  PageStore(const EntryCodec* codec, int entries_per_page, int32_t num_pages)
      : codec_(codec), entries_per_page_(entries_per_page), stride_(codec->page_stride(entries_per_page)),
        bytes_(stride_ * size_t(num_pages)) {}

  // Global slot = page * entries_per_page + offset (SPEC §6); byte offsets are 64-bit.
  void write(int64_t slot, const float* v) { codec_->write(v, page_of(slot), entries_per_page_, offset_of(slot)); }
  void read(int64_t slot, float* v) const { codec_->read(page_of(slot), entries_per_page_, offset_of(slot), v); }

  const EntryCodec& codec() const { return *codec_; }
  int dim() const { return codec_->dim(); }
  int entries_per_page() const { return entries_per_page_; }
  size_t page_stride() const { return stride_; }
  int32_t num_pages() const { return int32_t(bytes_.size() / (stride_ ? stride_ : 1)); }
  const uint8_t* data() const { return bytes_.data(); }
  size_t size_bytes() const { return bytes_.size(); }

 private:
  uint8_t* page_of(int64_t slot) { return bytes_.data() + size_t(slot / entries_per_page_) * stride_; }
  const uint8_t* page_of(int64_t slot) const { return bytes_.data() + size_t(slot / entries_per_page_) * stride_; }
  int offset_of(int64_t slot) const { return int(slot % entries_per_page_); }

  const EntryCodec* codec_;
  int entries_per_page_;
  size_t stride_;
  std::vector<uint8_t> bytes_;
};

}  // namespace dsv4
