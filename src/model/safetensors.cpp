#include "model/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <limits>
#include <optional>

#include <nlohmann/json.hpp>

#include "common/error.h"
#include "common/text.h"
#include "numerics/ue8m0.h"
#include "numerics/bf16.h"
#include "model/files.h"
#include "model/json_reader.h"

namespace dsv4 {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

struct DTypeInfo {
  DType type;
  std::string_view name;
  size_t size;
};

constexpr DTypeInfo kDTypes[] = {
    {DType::kBool, "BOOL", 1},      {DType::kU8, "U8", 1},          {DType::kI8, "I8", 1},
    {DType::kI16, "I16", 2},        {DType::kI32, "I32", 4},        {DType::kI64, "I64", 8},
    {DType::kF16, "F16", 2},        {DType::kBF16, "BF16", 2},      {DType::kF32, "F32", 4},
    {DType::kF64, "F64", 8},        {DType::kF8E4M3, "F8_E4M3", 1}, {DType::kF8E5M2, "F8_E5M2", 1},
    {DType::kF8E8M0, "F8_E8M0", 1},
};

// The reference reader refuses headers above 100 MB; so do we, before parsing.
constexpr uint64_t kMaxHeaderBytes = 100'000'000;
// Real headers nest three deep (header > entry > shape); the cap keeps hostile
// input from building deep trees.
constexpr int kMaxJsonDepth = 16;

const DTypeInfo& info(DType t) {
  for (const auto& d : kDTypes)
    if (d.type == t) return d;
  throw Error("invalid DType value " + std::to_string(int(t)));
}

// numel x element size, or nullopt when it does not fit in 64 bits.
std::optional<uint64_t> byte_count(const std::vector<int64_t>& shape, size_t elem) {
  uint64_t n = elem;
  for (int64_t d : shape)
    if (d < 0 || __builtin_mul_overflow(n, uint64_t(d), &n)) return std::nullopt;
  return n;
}

// Parses the header text: linear in its size (a Flash checkpoint's shards hold
// thousands of entries; hostile ones millions), refusing repeated keys, which
// nlohmann would silently collapse to the last.
json parse_header_json(std::string_view text, const std::string& origin) {
  try {
    return parse_json_text(text, origin, kMaxJsonDepth);
  } catch (const JsonParseError& e) {
    switch (e.kind) {
      case JsonParseError::Kind::kDuplicateKey:
        if (e.depth == 1) throw Error(origin + ": tensor '" + shown(e.key) + "' appears twice in the header");
        throw Error(origin + ": key '" + shown(e.key) + "' appears twice in one header object ('" + shown(e.path) +
                    "')");
      case JsonParseError::Kind::kTooDeep:
        throw Error(origin + ": header nests deeper than " + std::to_string(kMaxJsonDepth) + " levels");
      case JsonParseError::Kind::kSyntax:
        break;
    }
    throw Error(origin + ": header is not valid JSON: " + e.detail);
  }
}

std::map<std::string, std::string> parse_metadata(const json& j, const std::string& origin) {
  DSV4_REQUIRE(j.is_object(), origin + ": __metadata__ is not an object (got " + j.type_name() + ")");
  std::map<std::string, std::string> out;
  for (const auto& [key, value] : j.items()) {
    DSV4_REQUIRE(value.is_string(),
            origin + ": __metadata__ entry '" + shown(key) + "' is not a string (got " + value.type_name() + ")");
    out.emplace(key, value.get<std::string>());
  }
  return out;
}

// A non-negative JSON integer as uint64, or nullopt.
std::optional<uint64_t> as_unsigned(const json& v) {
  if (v.is_number_unsigned()) return v.get<uint64_t>();
  if (v.is_number_integer() && v.get<int64_t>() >= 0) return uint64_t(v.get<int64_t>());
  return std::nullopt;
}

// Validates one header entry against the data section and returns its view.
TensorView parse_entry(const std::string& name, const json& e, std::span<const uint8_t> data,
                       const std::string& origin) {
  const std::string where = origin + ": tensor '" + shown(name) + "': ";
  auto fail = [&](const std::string& problem) { return Error(where + problem); };
  if (!e.is_object()) throw fail(std::string("entry is not an object (got ") + e.type_name() + ")");
  for (const char* field : {"dtype", "shape", "data_offsets"})
    if (!e.contains(field)) throw fail(std::string("missing '") + field + "'");

  TensorView t;
  t.name = name;
  t.file = origin;
  const json& dtype = e.at("dtype");
  if (!dtype.is_string()) throw fail(std::string("'dtype' is not a string (got ") + dtype.type_name() + ")");
  try {
    t.dtype = parse_dtype(dtype.get<std::string>());
  } catch (const Error& err) {
    throw fail(err.what());
  }

  const json& shape = e.at("shape");
  if (!shape.is_array()) throw fail(std::string("'shape' is not an array (got ") + shape.type_name() + ")");
  for (const json& d : shape) {
    const auto v = as_unsigned(d);
    if (!v) throw fail("shape entry " + shown(d.dump()) + " is not a non-negative integer");
    if (*v > uint64_t(std::numeric_limits<int64_t>::max())) throw fail("shape entry " + d.dump() + " is too large");
    t.shape.push_back(int64_t(*v));
  }

  const json& offsets = e.at("data_offsets");
  if (!offsets.is_array() || offsets.size() != 2) throw fail("'data_offsets' is not an array of two integers");
  const auto begin = as_unsigned(offsets[0]), end = as_unsigned(offsets[1]);
  if (!begin || !end) throw fail("data_offsets " + shown(offsets.dump()) + " are not non-negative integers");
  if (*begin > *end) throw fail("data_offsets " + offsets.dump() + " end before they begin");
  if (*end > data.size())
    throw fail("data_offsets " + offsets.dump() + " lie outside the data section (" + std::to_string(data.size()) +
               " bytes)");
  const auto bytes = byte_count(t.shape, dtype_size(t.dtype));
  const std::string what = "shape " + shape_string(t.shape) + " x " + std::string(dtype_name(t.dtype));
  if (!bytes) throw fail(what + " overflows 64 bits");
  if (*bytes != *end - *begin)
    throw fail(what + " = " + std::to_string(*bytes) + " bytes but data_offsets span " + std::to_string(*end - *begin));
  t.bytes = data.subspan(*begin, *end - *begin);
  return t;
}

// Two tensors may not share a byte (empty tensors share none).
void check_overlaps(const std::vector<TensorView>& tensors, const uint8_t* data, const std::string& origin) {
  struct Range {
    size_t begin, end;
    const std::string* name;
  };
  std::vector<Range> ranges;
  for (const auto& t : tensors) {
    if (t.bytes.empty()) continue;
    const size_t b = size_t(t.bytes.data() - data);
    ranges.push_back({b, b + t.bytes.size(), &t.name});
  }
  std::sort(ranges.begin(), ranges.end(), [](const Range& a, const Range& b) { return a.begin < b.begin; });
  for (size_t i = 1; i < ranges.size(); ++i) {
    const Range &a = ranges[i - 1], &b = ranges[i];
    DSV4_REQUIRE(a.end <= b.begin, origin + ": tensors '" + shown(*a.name) + "' [" + std::to_string(a.begin) + ", " +
                                  std::to_string(a.end) + ") and '" + shown(*b.name) + "' [" + std::to_string(b.begin) +
                                  ", " + std::to_string(b.end) + ") overlap");
  }
}

// The index's weight_map: tensor name -> shard file (a plain name in the same directory).
std::map<std::string, std::string> read_weight_map(const fs::path& index) {
  const std::string origin = index.string();
  json j;
  try {
    j = parse_json_text(read_file_text(index), origin);
  } catch (const JsonParseError& e) {
    if (e.kind != JsonParseError::Kind::kSyntax) throw;
    throw Error(origin + ": not valid JSON: " + e.detail);
  }
  DSV4_REQUIRE(j.is_object() && j.contains("weight_map") && j.at("weight_map").is_object(),
          origin + ": expected an object with a 'weight_map' object");
  std::map<std::string, std::string> map;
  for (const auto& [tensor, file] : j.at("weight_map").items()) {
    DSV4_REQUIRE(file.is_string(), origin + ": weight_map entry '" + shown(tensor) + "' is not a file name");
    const std::string f = file.get<std::string>();
    // Shards live next to the index; refuse paths that would leave the directory.
    const fs::path p(f);
    DSV4_REQUIRE(
        !f.empty() && p.is_relative() && std::none_of(p.begin(), p.end(), [](const fs::path& c) { return c == ".."; }),
        origin + ": weight_map entry '" + shown(tensor) + "' names '" + shown(f) +
            "', which is not a file in the checkpoint directory");
    map.emplace(tensor, f);
  }
  DSV4_REQUIRE(!map.empty(), origin + ": weight_map is empty");
  return map;
}

}  // namespace

std::string_view dtype_name(DType t) { return info(t).name; }
size_t dtype_size(DType t) { return info(t).size; }

DType parse_dtype(std::string_view name) {
  for (const auto& d : kDTypes)
    if (d.name == name) return d.type;
  throw Error("unknown dtype '" + shown(name) + "'");
}

std::string shape_string(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

std::vector<float> TensorView::floats() const {
  const size_t n = size_t(numel());
  std::vector<float> out(n);
  const uint8_t* p = bytes.data();
  for (size_t i = 0; i < n; ++i) {
    if (dtype == DType::kBF16) {
      uint16_t b;
      std::memcpy(&b, p + 2 * i, 2);
      out[i] = bf16_to_float(b);
    } else if (dtype == DType::kF32) {
      std::memcpy(&out[i], p + 4 * i, 4);
    } else if (dtype == DType::kF8E8M0) {
      out[i] = ue8m0_to_float(p[i]);
    } else {
      throw Error(file + ": tensor '" + shown(name) + "': cannot read " + std::string(dtype_name(dtype)) + " as float");
    }
  }
  return out;
}

int64_t TensorView::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

std::string TensorView::describe() const {
  return name + " " + shape_string(shape) + " " + std::string(dtype_name(dtype));
}

// ---- SafetensorsFile ---------------------------------------------------------

std::unique_ptr<SafetensorsFile> SafetensorsFile::open(const fs::path& path) {
  std::unique_ptr<SafetensorsFile> file(new SafetensorsFile());
  file->origin_ = path.string();
  // O_NONBLOCK: opening a FIFO must fail the type check below, not wait for a writer.
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  DSV4_REQUIRE(fd >= 0, file->origin_ + ": cannot open: " + std::strerror(errno));
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    const std::string problem = file_problem(path);
    throw Error(file->origin_ + ": not a regular file" + (problem.empty() ? "" : " (it " + problem + ")"));
  }
  const size_t size = size_t(st.st_size);
  if (size > 0) {  // mmap refuses length 0; an empty file fails the length check below
    void* map = ::mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0);
    const int err = errno;
    ::close(fd);
    DSV4_REQUIRE(map != MAP_FAILED, file->origin_ + ": mmap failed: " + std::strerror(err));
    file->map_ = map;
    file->map_size_ = size;
  } else {
    ::close(fd);
  }
  file->parse_header({static_cast<const uint8_t*>(file->map_), file->map_size_});
  return file;
}

std::unique_ptr<SafetensorsFile> SafetensorsFile::parse(std::span<const uint8_t> buffer, std::string origin) {
  std::unique_ptr<SafetensorsFile> file(new SafetensorsFile());
  file->origin_ = std::move(origin);
  file->parse_header(buffer);
  return file;
}

SafetensorsFile::~SafetensorsFile() {
  if (map_) ::munmap(map_, map_size_);
}

const TensorView* SafetensorsFile::find(std::string_view name) const {
  const auto it = by_name_.find(name);
  return it == by_name_.end() ? nullptr : &tensors_[it->second];
}

void SafetensorsFile::parse_header(std::span<const uint8_t> buffer) {
  const std::string& o = origin_;
  DSV4_REQUIRE(buffer.size() >= 8,
          o + ": file is " + std::to_string(buffer.size()) + " bytes, shorter than the 8-byte header length");
  uint64_t n = 0;
  for (int i = 0; i < 8; ++i) n |= uint64_t(buffer[size_t(i)]) << (8 * i);
  DSV4_REQUIRE(n <= buffer.size() - 8, o + ": header length " + std::to_string(n) + " exceeds the " +
                                      std::to_string(buffer.size() - 8) + " bytes that follow it");
  DSV4_REQUIRE(n <= kMaxHeaderBytes, o + ": header length " + std::to_string(n) + " exceeds the " +
                                    std::to_string(kMaxHeaderBytes) + "-byte limit");
  const std::string_view text(reinterpret_cast<const char*>(buffer.data() + 8), size_t(n));
  const json header = parse_header_json(text, o);
  DSV4_REQUIRE(header.is_object(), o + ": header is not a JSON object (got " + header.type_name() + ")");

  const auto data = buffer.subspan(8 + size_t(n));
  for (const auto& [key, value] : header.items()) {
    if (key == "__metadata__")
      metadata_ = parse_metadata(value, o);
    else
      tensors_.push_back(parse_entry(key, value, data, o));
  }
  check_overlaps(tensors_, data.data(), o);
  for (size_t i = 0; i < tensors_.size(); ++i) by_name_.emplace(tensors_[i].name, i);
}

// ---- Checkpoint ----------------------------------------------------------------

namespace {

// Opens the shards an index names, each once, and checks that each tensor lives where the index says.
std::vector<std::unique_ptr<SafetensorsFile>> open_indexed(const fs::path& dir, const fs::path& index) {
  const auto weight_map = read_weight_map(index);
  std::map<std::string, SafetensorsFile*> shards;
  std::vector<std::unique_ptr<SafetensorsFile>> files;
  for (const auto& [tensor, shard] : weight_map) {
    if (shards.count(shard)) continue;
    const fs::path p = dir / shard;
    const std::string problem = file_problem(p);
    DSV4_REQUIRE(problem.empty(), index.string() + ": shard '" + shown(shard) + "' (holding '" + shown(tensor) + "') " +
                                 problem + ": " + p.string());
    files.push_back(SafetensorsFile::open(p));
    shards.emplace(shard, files.back().get());
  }
  for (const auto& [tensor, shard] : weight_map)
    DSV4_REQUIRE(shards.at(shard)->find(tensor) != nullptr, index.string() + ": tensor '" + shown(tensor) +
                                                           "' is mapped to '" + shown(shard) +
                                                           "', which does not hold it");
  return files;
}

// Every *.safetensors of a directory, in name order.
std::vector<std::unique_ptr<SafetensorsFile>> open_directory(const fs::path& dir) {
  std::vector<fs::path> paths;
  // Every *.safetensors entry, whatever its type: a FIFO or a directory so
  // named is reported by SafetensorsFile::open rather than skipped unseen.
  for (const auto& entry : fs::directory_iterator(dir))
    if (entry.path().extension() == ".safetensors") paths.push_back(entry.path());
  DSV4_REQUIRE(!paths.empty(), dir.string() + ": no .safetensors files and no model.safetensors.index.json");
  std::sort(paths.begin(), paths.end());
  std::vector<std::unique_ptr<SafetensorsFile>> files;
  for (const auto& p : paths) files.push_back(SafetensorsFile::open(p));
  return files;
}

}  // namespace

Checkpoint Checkpoint::open(const fs::path& path) {
  Checkpoint c;
  c.path_ = path;
  std::error_code ec;
  const auto status = fs::status(path, ec);
  DSV4_REQUIRE(fs::exists(status), path.string() + ": no such file or directory");
  try {
    if (fs::is_directory(status)) {
      const fs::path index = path / "model.safetensors.index.json";
      const bool indexed = fs::exists(fs::symlink_status(index));
      if (indexed) require_regular_file(index);
      c.files_ = indexed ? open_indexed(path, index) : open_directory(path);
    } else if (path.filename().string().ends_with(".index.json")) {  // the index itself
      require_regular_file(path);
      c.files_ = open_indexed(path.parent_path(), path);
    } else {
      c.files_.push_back(SafetensorsFile::open(path));
    }
  } catch (const fs::filesystem_error& e) {  // e.g. an unreadable directory
    throw Error(path.string() + ": " + e.what());
  }
  for (const auto& f : c.files_)
    for (const auto& t : f->tensors()) {
      const auto [it, fresh] = c.by_name_.emplace(t.name, &t);
      DSV4_REQUIRE(fresh, path.string() + ": tensor '" + shown(t.name) + "' appears in both " + it->second->file + " and " +
                         t.file);
    }
  return c;
}

const TensorView* Checkpoint::find(std::string_view name) const {
  const auto it = by_name_.find(name);
  return it == by_name_.end() ? nullptr : it->second;
}

std::vector<const TensorView*> Checkpoint::tensors() const {
  std::vector<const TensorView*> out;
  out.reserve(by_name_.size());
  for (const auto& [name, t] : by_name_) out.push_back(t);
  return out;
}

// ---- writing -------------------------------------------------------------------

std::vector<uint8_t> serialize_safetensors(const std::vector<TensorData>& tensors,
                                           const std::map<std::string, std::string>& metadata) {
  json header = json::object();
  uint64_t offset = 0;
  for (const auto& t : tensors) {
    const std::string where = "serialize_safetensors: tensor '" + shown(t.name) + "': ";
    DSV4_REQUIRE(t.name != "__metadata__" && !header.contains(t.name), where + "name is reserved or repeated");
    const auto bytes = byte_count(t.shape, dtype_size(t.dtype));
    DSV4_REQUIRE(bytes && *bytes == t.bytes.size(), where + "shape " + shape_string(t.shape) + " x " +
                                                   std::string(dtype_name(t.dtype)) + " does not match " +
                                                   std::to_string(t.bytes.size()) + " bytes");
    header[t.name] = {
        {"dtype", std::string(dtype_name(t.dtype))}, {"shape", t.shape}, {"data_offsets", {offset, offset + *bytes}}};
    offset += *bytes;
  }
  if (!metadata.empty()) header["__metadata__"] = metadata;
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');

  std::vector<uint8_t> out(8 + text.size());
  for (int i = 0; i < 8; ++i) out[size_t(i)] = uint8_t(uint64_t(text.size()) >> (8 * i));
  std::memcpy(out.data() + 8, text.data(), text.size());
  out.reserve(out.size() + offset);
  for (const auto& t : tensors) out.insert(out.end(), t.bytes.begin(), t.bytes.end());
  return out;
}

void write_safetensors(const fs::path& path, const std::vector<TensorData>& tensors,
                       const std::map<std::string, std::string>& metadata) {
  const auto bytes = serialize_safetensors(tensors, metadata);
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(bytes.data()), std::streamsize(bytes.size()));
  out.close();
  DSV4_REQUIRE(bool(out), path.string() + ": cannot write");
}

}  // namespace dsv4
