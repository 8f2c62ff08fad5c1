#pragma once
// A safetensors reader: memory-mapped, validated, and able to follow sharded
// checkpoints through model.safetensors.index.json.
//
// File layout: an 8-byte little-endian header length N, N bytes of JSON
// {name: {dtype, shape, data_offsets: [begin, end]}, "__metadata__": {...}},
// then the data section; offsets are relative to the data section.
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace dsv4 {

enum class DType { kBool, kU8, kI8, kI16, kI32, kI64, kF16, kBF16, kF32, kF64, kF8E4M3, kF8E5M2, kF8E8M0 };

std::string_view dtype_name(DType t);  // the safetensors spelling: "BF16", "F8_E4M3", ...
// "[a, b, c]": a shape as messages show it.
std::string shape_string(const std::vector<int64_t>& shape);
size_t dtype_size(DType t);            // bytes per element
// Parses a safetensors dtype name; throws Error for an unknown one.
DType parse_dtype(std::string_view name);

struct TensorView {
  std::string name;
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;
  std::span<const uint8_t> bytes;  // points into the mapped file
  std::string file;                // file it lives in, for messages

  int64_t numel() const;
  // Every element as a float (F32, BF16 or F8_E8M0 tensors); throws Error
  // naming the tensor for any other dtype.
  std::vector<float> floats() const;
  std::string describe() const;  // "name [a, b] DTYPE"
};

// One mapped .safetensors file. Opening validates: header length within the
// file (and at most 100 MB), the header is a JSON object (nesting at most 16
// deep) without repeated keys, so a tensor name appears once, every dtype is
// known, every shape is non-negative with shape x dtype size == byte range
// (no 64-bit overflow), every range lies inside the data section, ranges do
// not overlap (gaps are allowed), and __metadata__ maps strings to strings.
// Any violation throws Error naming the file and the tensor. Views may be
// unaligned: read multi-byte elements with memcpy. (A file truncated by
// someone else while mapped raises SIGBUS on access; mmap cannot prevent it.)
class SafetensorsFile {
 public:
  static std::unique_ptr<SafetensorsFile> open(const std::filesystem::path& path);
  // Parses an in-memory buffer (the fuzz target's entry point). The buffer must
  // outlive the returned object.
  static std::unique_ptr<SafetensorsFile> parse(std::span<const uint8_t> buffer, std::string origin);
  ~SafetensorsFile();
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  const std::vector<TensorView>& tensors() const { return tensors_; }
  const TensorView* find(std::string_view name) const;  // null when absent
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  const std::string& origin() const { return origin_; }

 private:
  SafetensorsFile() = default;
  void parse_header(std::span<const uint8_t> buffer);

  std::string origin_;
  void* map_ = nullptr;
  size_t map_size_ = 0;
  std::vector<TensorView> tensors_;
  std::map<std::string, size_t, std::less<>> by_name_;
  std::map<std::string, std::string> metadata_;
};

// A checkpoint: one .safetensors file, a directory of them, or a directory with
// model.safetensors.index.json (sharded; the index file's own path works too).
// Tensor names must be unique across files; the index's weight_map must name
// files that exist and tensors they hold.
class Checkpoint {
 public:
  static Checkpoint open(const std::filesystem::path& path);

  const TensorView* find(std::string_view name) const;  // null when absent
  // All tensors, sorted by name.
  std::vector<const TensorView*> tensors() const;
  const std::filesystem::path& path() const { return path_; }
  const std::vector<std::unique_ptr<SafetensorsFile>>& files() const { return files_; }

 private:
  std::filesystem::path path_;
  std::vector<std::unique_ptr<SafetensorsFile>> files_;
  std::map<std::string, const TensorView*, std::less<>> by_name_;
};

// One tensor to write: its bytes must hold numel x dtype size bytes.
struct TensorData {
  std::string name;
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;
  std::span<const uint8_t> bytes;
};

// A complete safetensors image: tensors packed back to back in the given
// order, the JSON header padded with spaces to a multiple of 8 bytes (so the
// data section is 8-byte aligned, as the reference writer does). Throws Error
// on a duplicate name, a negative dim or a byte count that does not match.
std::vector<uint8_t> serialize_safetensors(const std::vector<TensorData>& tensors,
                                           const std::map<std::string, std::string>& metadata = {});
// serialize_safetensors, written to `path`; throws Error when it cannot be written.
void write_safetensors(const std::filesystem::path& path, const std::vector<TensorData>& tensors,
                       const std::map<std::string, std::string>& metadata = {});

}  // namespace dsv4
