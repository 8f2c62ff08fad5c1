#include "cache/entry_codec.h"

#include <cstring>

#include "cache/fp8_ds_mla.h"

namespace dsv4 {
namespace {

class Fp8DsMlaCodec final : public EntryCodec {
 public:
  int dim() const override { return kKvDim; }
  size_t page_stride(int b) const override { return fp8_ds_mla_page_stride(b); }
  void write(const float* v, uint8_t* page, int b, int t) const override { fp8_ds_mla_encode(v, page, b, t); }
  void read(const uint8_t* page, int b, int t, float* v) const override { fp8_ds_mla_decode(page, b, t, v); }
  std::string name() const override { return "fp8_ds_mla"; }
};

class IndexKeyCodec final : public EntryCodec {
 public:
  explicit IndexKeyCodec(IndexKeyFormat f) : f_(f) {}
  int dim() const override { return kIndexDim; }
  size_t page_stride(int b) const override { return index_key_page_stride(f_, b); }
  void write(const float* v, uint8_t* page, int b, int t) const override { index_key_encode(f_, v, page, b, t); }
  void read(const uint8_t* page, int b, int t, float* v) const override { index_key_decode(f_, page, b, t, v); }
  std::string name() const override { return "index_keys_" + std::string(index_key_format_name(f_)); }

 private:
  IndexKeyFormat f_;
};

class F32Codec final : public EntryCodec {
 public:
  explicit F32Codec(int dim) : dim_(dim) {}
  int dim() const override { return dim_; }
  size_t page_stride(int b) const override { return sizeof(float) * size_t(dim_) * size_t(b); }
  void write(const float* v, uint8_t* page, int, int t) const override {
    std::memcpy(page + sizeof(float) * size_t(dim_) * t, v, sizeof(float) * dim_);
  }
  void read(const uint8_t* page, int, int t, float* v) const override {
    std::memcpy(v, page + sizeof(float) * size_t(dim_) * t, sizeof(float) * dim_);
  }
  std::string name() const override { return "f32x" + std::to_string(dim_); }

 private:
  int dim_;
};

}  // namespace

std::unique_ptr<EntryCodec> make_fp8_ds_mla_codec() { return std::make_unique<Fp8DsMlaCodec>(); }
std::unique_ptr<EntryCodec> make_index_key_codec(IndexKeyFormat f) { return std::make_unique<IndexKeyCodec>(f); }
std::unique_ptr<EntryCodec> make_f32_codec(int dim) { return std::make_unique<F32Codec>(dim); }

}  // namespace dsv4
