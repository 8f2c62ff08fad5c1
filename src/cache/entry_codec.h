#pragma once
// How one cache entry is laid out in a page: the production byte formats of
// SPEC §6 (fp8_ds_mla, FP8/MXFP4 indexer keys) or plain float32 (the exact
// profile's caches and the compressor state rows).
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "cache/index_key_format.h"

namespace dsv4 {

class EntryCodec {
 public:
  virtual ~EntryCodec() = default;
  virtual int dim() const = 0;  // floats per entry
  virtual size_t page_stride(int entries_per_page) const = 0;
  virtual void write(const float* v, uint8_t* page, int entries_per_page, int t) const = 0;
  virtual void read(const uint8_t* page, int entries_per_page, int t, float* v) const = 0;
  virtual std::string name() const = 0;
};

std::unique_ptr<EntryCodec> make_fp8_ds_mla_codec();                // 512 dims, SPEC §6
std::unique_ptr<EntryCodec> make_index_key_codec(IndexKeyFormat f);  // 128 dims, SPEC §6
std::unique_ptr<EntryCodec> make_f32_codec(int dim);                 // dim floats per entry

}  // namespace dsv4
