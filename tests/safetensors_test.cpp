// The safetensors reader (SPEC §3): golden files, in-memory images, corrupted
// copies of a golden file, and sharded checkpoints with and without an index.
#include "model/safetensors.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <sys/stat.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <functional>
#include <set>

#include <nlohmann/json.hpp>

#include "common/error.h"
#include "support/error_of.h"
#include "support/temp_dir.h"
#include "support/timing.h"

namespace dsv4 {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;
using Bytes = std::vector<uint8_t>;

const fs::path kGolden = fs::path(DSV4_GOLDEN_DIR) / "mini.weights.safetensors";

using dsv4::test::TempDir;

Bytes read_bytes(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return Bytes(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

void write_bytes(const fs::path& p, const Bytes& b) {
  std::ofstream out(p, std::ios::binary);
  out.write(reinterpret_cast<const char*>(b.data()), std::streamsize(b.size()));
}

// An image with an arbitrary header text and data section.
Bytes raw_image(const std::string& header, const Bytes& data) {
  Bytes out(8 + header.size() + data.size());
  for (int i = 0; i < 8; ++i) out[size_t(i)] = uint8_t(uint64_t(header.size()) >> (8 * i));
  std::copy(header.begin(), header.end(), out.begin() + 8);
  std::copy(data.begin(), data.end(), out.begin() + 8 + long(header.size()));
  return out;
}

// The golden file with its header JSON edited and its data section kept.
Bytes golden_with_header(const std::function<void(json&)>& edit) {
  const Bytes g = read_bytes(kGolden);
  uint64_t n = 0;
  for (int i = 0; i < 8; ++i) n |= uint64_t(g[size_t(i)]) << (8 * i);
  json header = json::parse(g.begin() + 8, g.begin() + 8 + long(n));
  edit(header);
  return raw_image(header.dump(), Bytes(g.begin() + 8 + long(n), g.end()));
}

using dsv4::test::error_of;

std::string parse_error(const Bytes& image) {
  return error_of([&] { SafetensorsFile::parse(image, "img.safetensors"); });
}

std::string open_error(const fs::path& p) {
  return error_of([&] { SafetensorsFile::open(p); });
}


// ---- dtypes -------------------------------------------------------------------------

TEST(Dtype, NamesRoundTripAndSizes) {
  const std::map<std::string, size_t> expected = {{"BOOL", 1},    {"U8", 1},      {"I8", 1},     {"I16", 2}, {"I32", 4},
                                                  {"I64", 8},     {"F16", 2},     {"BF16", 2},   {"F32", 4}, {"F64", 8},
                                                  {"F8_E4M3", 1}, {"F8_E5M2", 1}, {"F8_E8M0", 1}};
  for (const auto& [name, size] : expected) {
    const DType t = parse_dtype(name);
    EXPECT_EQ(dtype_name(t), name);
    EXPECT_EQ(dtype_size(t), size) << name;
  }
  EXPECT_MENTIONS(error_of([] { parse_dtype("F12"); }), "unknown dtype 'F12'");
  EXPECT_MENTIONS(error_of([] { parse_dtype("bf16"); }), "unknown dtype 'bf16'");
}

// ---- the golden file ------------------------------------------------------------------

TEST(Safetensors, OpensGoldenFileAndMapsItsBytes) {
  const auto f = SafetensorsFile::open(kGolden);
  EXPECT_EQ(f->tensors().size(), 38u);  // 8 + 18 + 12 (SWA-only, C4A, C128A)
  const TensorView* t = f->find("layers.0.attn.wq_a.weight");
  ASSERT_NE(t, nullptr);
  EXPECT_EQ(t->dtype, DType::kBF16);
  EXPECT_EQ(t->shape, (std::vector<int64_t>{128, 256}));
  EXPECT_EQ(t->numel(), 128 * 256);
  EXPECT_EQ(t->describe(), "layers.0.attn.wq_a.weight [128, 256] BF16");
  EXPECT_EQ(t->file, kGolden.string());
  EXPECT_EQ(f->find("layers.0.attn.nonexistent"), nullptr);

  // The view's bytes are the file's bytes at 8 + header + data_offsets[0].
  const Bytes raw = read_bytes(kGolden);
  uint64_t n = 0;
  for (int i = 0; i < 8; ++i) n |= uint64_t(raw[size_t(i)]) << (8 * i);
  const json header = json::parse(raw.begin() + 8, raw.begin() + 8 + long(n));
  for (const TensorView& v : f->tensors()) {
    const auto begin = header.at(v.name).at("data_offsets")[0].get<size_t>();
    ASSERT_EQ(v.bytes.size(), header.at(v.name).at("data_offsets")[1].get<size_t>() - begin) << v.name;
    EXPECT_EQ(std::memcmp(v.bytes.data(), raw.data() + 8 + n + begin, v.bytes.size()), 0) << v.name;
  }
}

// ---- round trip through the writer ---------------------------------------------------------

TEST(Safetensors, WriterRoundTrip) {
  const Bytes a = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12}, b = {0xaa, 0xbb};
  const std::vector<TensorData> tensors = {{"a", DType::kF32, {3}, a},
                                           {"b", DType::kBF16, {1, 1}, b},
                                           {"empty", DType::kI64, {0, 4}, {}},
                                           {"scalar", DType::kU8, {}, std::span(b).first(1)}};
  const Bytes image = serialize_safetensors(tensors, {{"format", "pt"}});
  uint64_t n = 0;
  for (int i = 0; i < 8; ++i) n |= uint64_t(image[size_t(i)]) << (8 * i);
  EXPECT_EQ(n % 8, 0u) << "data section is 8-byte aligned";

  const auto f = SafetensorsFile::parse(image, "mem");
  ASSERT_EQ(f->tensors().size(), 4u);
  EXPECT_EQ(f->metadata().at("format"), "pt");
  for (const auto& t : tensors) {
    const TensorView* v = f->find(t.name);
    ASSERT_NE(v, nullptr) << t.name;
    EXPECT_EQ(v->dtype, t.dtype);
    EXPECT_EQ(v->shape, t.shape);
    EXPECT_EQ(Bytes(v->bytes.begin(), v->bytes.end()), Bytes(t.bytes.begin(), t.bytes.end())) << t.name;
  }
  EXPECT_EQ(f->find("scalar")->numel(), 1);
  EXPECT_EQ(f->find("empty")->numel(), 0);
}

TEST(Safetensors, WriterRefusesInconsistentTensors) {
  const Bytes a = {1, 2, 3};
  EXPECT_MENTIONS(error_of([&] { serialize_safetensors({{"a", DType::kF32, {1}, a}}); }), "'a'");
  EXPECT_MENTIONS(error_of([&] {
                    serialize_safetensors({{"a", DType::kU8, {3}, a}, {"a", DType::kU8, {3}, a}});
                  }),
                  "repeated");
  EXPECT_MENTIONS(error_of([&] { serialize_safetensors({{"n", DType::kU8, {-3}, a}}); }), "'n'");
}

TEST(Safetensors, AcceptsGapsEmptyTensorsAndPadding) {
  const Bytes data(16, 7);
  const auto f = SafetensorsFile::parse(raw_image(R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},)"
                                                  R"("z":{"dtype":"F32","shape":[0],"data_offsets":[2,2]},)"
                                                  R"("b":{"dtype":"I16","shape":[2],"data_offsets":[8,12]}}   )",
                                                  data),
                                        "mem");
  EXPECT_EQ(f->tensors().size(), 3u);
  EXPECT_EQ(f->find("b")->bytes.data(), f->find("a")->bytes.data() + 8);
  EXPECT_TRUE(SafetensorsFile::parse(raw_image("{}", {}), "mem")->tensors().empty());
}

// ---- malformed images, each error naming the problem --------------------------------------

TEST(SafetensorsErrors, FileStructure) {
  EXPECT_MENTIONS(parse_error({1, 2, 3}), "shorter than the 8-byte header length");
  EXPECT_MENTIONS(parse_error({}), "img.safetensors: file is 0 bytes");
  Bytes beyond = raw_image("{}", {});
  beyond[0] = 200;
  EXPECT_MENTIONS(parse_error(beyond), "header length 200 exceeds the 2 bytes");
  Bytes huge = raw_image("{}", {});
  huge[7] = 0x80;
  EXPECT_MENTIONS(parse_error(huge), "exceeds");
  // Within the file but above the 100 MB cap: refused before parsing.
  Bytes big(8 + 100'000'001, ' ');
  const uint64_t n = 100'000'001;
  for (int i = 0; i < 8; ++i) big[size_t(i)] = uint8_t(n >> (8 * i));
  EXPECT_MENTIONS(parse_error(big), "-byte limit");
}

TEST(SafetensorsErrors, HeaderJson) {
  EXPECT_MENTIONS(parse_error(raw_image("{not json", {})), "header is not valid JSON");
  EXPECT_MENTIONS(parse_error(raw_image("", {})), "header is not valid JSON");
  EXPECT_MENTIONS(parse_error(raw_image("{} x", {})), "header is not valid JSON");
  EXPECT_MENTIONS(parse_error(raw_image("{\"a\xff\":1}", {})), "header is not valid JSON");
  EXPECT_MENTIONS(parse_error(raw_image("[1, 2]", {})), "header is not a JSON object (got array)");
  EXPECT_MENTIONS(parse_error(raw_image(std::string(40, '[') + std::string(40, ']'), {})), "nests deeper");
  EXPECT_MENTIONS(parse_error(raw_image(R"({"__metadata__": [1]})", {})), "__metadata__ is not an object");
  EXPECT_MENTIONS(parse_error(raw_image(R"({"__metadata__": {"k": 1}})", {})),
                  "__metadata__ entry 'k' is not a string");
}

TEST(SafetensorsErrors, DuplicateNames) {
  const std::string e = R"({"dtype":"U8","shape":[1],"data_offsets":[0,1]})";
  EXPECT_MENTIONS(parse_error(raw_image("{\"w\":" + e + ",\"w\":" + e + "}", {1})),
                  "tensor 'w' appears twice in the header");
  EXPECT_MENTIONS(parse_error(raw_image(R"({"w":{"dtype":"U8","dtype":"I8","shape":[1],"data_offsets":[0,1]}})", {1})),
                  "key 'dtype' appears twice");
}

// One entry `"w": <entry>` over a 16-byte data section; returns the error.
std::string entry_error(const std::string& entry) {
  return parse_error(raw_image("{\"w\":" + entry + "}", Bytes(16, 0)));
}

TEST(SafetensorsErrors, EntryFields) {
  EXPECT_MENTIONS(entry_error("5"), "img.safetensors: tensor 'w': entry is not an object (got number)");
  EXPECT_MENTIONS(entry_error(R"({"shape":[1],"data_offsets":[0,1]})"), "tensor 'w': missing 'dtype'");
  EXPECT_MENTIONS(entry_error(R"({"dtype":"U8","data_offsets":[0,1]})"), "missing 'shape'");
  EXPECT_MENTIONS(entry_error(R"({"dtype":"U8","shape":[1]})"), "missing 'data_offsets'");
  EXPECT_MENTIONS(entry_error(R"({"dtype":7,"shape":[1],"data_offsets":[0,1]})"), "'dtype' is not a string");
  EXPECT_MENTIONS(entry_error(R"({"dtype":"F12","shape":[1],"data_offsets":[0,1]})"),
                  "tensor 'w': unknown dtype 'F12'");
  EXPECT_MENTIONS(entry_error(R"({"dtype":"U8","shape":1,"data_offsets":[0,1]})"), "'shape' is not an array");
  EXPECT_MENTIONS(entry_error(R"({"dtype":"U8","shape":[-1],"data_offsets":[0,1]})"),
                  "shape entry -1 is not a non-negative integer");
  EXPECT_MENTIONS(entry_error(R"({"dtype":"U8","shape":[1.5],"data_offsets":[0,1]})"), "shape entry 1.5");
  EXPECT_MENTIONS(entry_error(R"({"dtype":"U8","shape":[18446744073709551615],"data_offsets":[0,1]})"), "too large");
  EXPECT_MENTIONS(entry_error(R"({"dtype":"F32","shape":[4294967296,4294967296,16],"data_offsets":[0,0]})"),
                  "overflows 64 bits");
  EXPECT_MENTIONS(entry_error(R"({"dtype":"U8","shape":[1],"data_offsets":[0]})"), "array of two integers");
  EXPECT_MENTIONS(entry_error(R"({"dtype":"U8","shape":[1],"data_offsets":[-1,0]})"), "not non-negative integers");
  EXPECT_MENTIONS(entry_error(R"({"dtype":"U8","shape":[1],"data_offsets":[4,3]})"), "end before they begin");
  EXPECT_MENTIONS(entry_error(R"({"dtype":"U8","shape":[4],"data_offsets":[14,18]})"),
                  "data_offsets [14,18] lie outside the data section (16 bytes)");
  EXPECT_MENTIONS(entry_error(R"({"dtype":"F32","shape":[2,3],"data_offsets":[0,16]})"),
                  "tensor 'w': shape [2, 3] x F32 = 24 bytes but data_offsets span 16");
}

TEST(SafetensorsErrors, OverlappingRanges) {
  const std::string header = R"({"a":{"dtype":"U8","shape":[8],"data_offsets":[0,8]},)"
                             R"("b":{"dtype":"U8","shape":[4],"data_offsets":[6,10]}})";
  const std::string msg = parse_error(raw_image(header, Bytes(16, 0)));
  EXPECT_MENTIONS(msg, "'a' [0, 8) and 'b' [6, 10) overlap");
}

// ---- corrupted copies of the golden file, opened from disk ---------------------------------

TEST(SafetensorsErrors, CorruptedGoldenCopies) {
  TempDir dir;
  const Bytes golden = read_bytes(kGolden);
  auto write = [&](const std::string& name, const Bytes& b) {
    write_bytes(dir / name, b);
    return dir / name;
  };

  const std::string truncated = open_error(write("truncated.safetensors", Bytes(golden.begin(), golden.end() - 100)));
  EXPECT_MENTIONS(truncated, "truncated.safetensors: tensor 'layers.2.attn.wq_b.weight'");
  EXPECT_MENTIONS(truncated, "lie outside the data section");
  EXPECT_MENTIONS(open_error(write("stub.safetensors", Bytes(golden.begin(), golden.begin() + 5))),
                  "stub.safetensors: file is 5 bytes");
  EXPECT_MENTIONS(open_error(write("empty.safetensors", {})), "empty.safetensors: file is 0 bytes");
  EXPECT_MENTIONS(open_error(write("header.safetensors", Bytes(golden.begin(), golden.begin() + 1000))),
                  "header.safetensors: header length 3712 exceeds the 992 bytes");
  Bytes garbage = golden;
  garbage[8] = '#';
  EXPECT_MENTIONS(open_error(write("garbage.safetensors", garbage)), "garbage.safetensors: header is not valid JSON");

  const std::string sink = "layers.0.attn.attn_sink";
  EXPECT_MENTIONS(
      open_error(write("dtype.safetensors", golden_with_header([&](json& h) { h[sink]["dtype"] = "F31"; }))),
      "dtype.safetensors: tensor 'layers.0.attn.attn_sink': unknown dtype 'F31'");
  EXPECT_MENTIONS(open_error(write("size.safetensors", golden_with_header([&](json& h) { h[sink]["shape"] = {5}; }))),
                  "tensor 'layers.0.attn.attn_sink': shape [5] x F32 = 20 bytes but data_offsets span 16");
  EXPECT_MENTIONS(open_error(write("overlap.safetensors", golden_with_header([&](json& h) {
                                     h["layers.1.attn.attn_sink"]["data_offsets"] = {8, 24};
                                   }))),
                  "'layers.0.attn.attn_sink' [0, 16) and 'layers.1.attn.attn_sink' [8, 24) overlap");
  EXPECT_MENTIONS(open_error(write("past.safetensors", golden_with_header([&](json& h) {
                                     h[sink]["data_offsets"] = {golden.size(), golden.size() + 16};
                                   }))),
                  "tensor 'layers.0.attn.attn_sink': data_offsets");

  EXPECT_MENTIONS(open_error(dir / "absent.safetensors"), "absent.safetensors: cannot open");
  EXPECT_MENTIONS(open_error(dir.path()), "not a regular file");
}

// ---- large headers ----------------------------------------------------------------------------

// A header of n one-byte U8 tensors "t<i>" (byte i holds i % 251), in a
// shuffled order so that the map, not the input order, finds them; `tail`
// is appended inside the top-level object.
Bytes many_tensors(int n, const std::string& tail = "") {
  std::string header = "{";
  for (int k = 0; k < n; ++k) {
    const int i = int((int64_t(k) * 7919) % n);  // 7919 is prime and does not divide the n used here
    if (k) header.push_back(',');
    header.append("\"t").append(std::to_string(i)).append("\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[");
    header.append(std::to_string(i)).append(",").append(std::to_string(i + 1)).append("]}");
  }
  header.append(tail).append("}");
  Bytes data(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) data[size_t(i)] = uint8_t(i % 251);
  return raw_image(header, data);
}

TEST(SafetensorsLarge, EightyThousandEntriesParseAndResolve) {
  const int n = 80000;
  const Bytes image = many_tensors(n);
  const auto t0 = std::chrono::steady_clock::now();
  const auto f = SafetensorsFile::parse(image, "big.safetensors");
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  ASSERT_EQ(f->tensors().size(), size_t(n));
  const uint8_t* data = image.data() + image.size() - n;
  for (int i = 0; i < n; ++i) {
    const std::string name = std::string("t").append(std::to_string(i));  // (chained + trips GCC 12's -Wrestrict)
    const TensorView* t = f->find(name);
    ASSERT_NE(t, nullptr) << "t" << i;
    ASSERT_EQ(t->bytes.size(), 1u) << "t" << i;
    ASSERT_EQ(t->bytes.data(), data + i) << "t" << i;
    ASSERT_EQ(t->bytes[0], uint8_t(i % 251)) << "t" << i;
  }
  std::printf("80,000 entries (%zu header bytes) parsed in %.3f s\n", image.size() - n - 8, seconds);
}

TEST(SafetensorsLarge, ParseTimeIsLinear) {
  // 8x the entries: ~8x the time (n log n for the maps); the callback parser
  // this replaced rescanned the header object per entry (64x, minutes at 80k).
  const Bytes small_image = many_tensors(10000), large_image = many_tensors(80000);
  const auto parse = [](const Bytes& image) { SafetensorsFile::parse(image, "big.safetensors"); };
  const auto [small, large] = dsv4::test::fastest_in_turn([&] { parse(small_image); }, [&] { parse(large_image); });
  // 40x: 16x on an idle development machine (the larger header leaves the
  // caches), 25x beside a build; a rescan per entry is 64x.
  EXPECT_LT(large, 40 * small) << "10k entries: " << small << " s, 80k entries: " << large << " s";
}

TEST(SafetensorsLarge, ErrorsDeepInALargeHeader) {
  const int n = 50000;
  const std::string entry = R"({"dtype":"U8","shape":[1],"data_offsets":[0,1]})";
  EXPECT_MENTIONS(parse_error(many_tensors(n, ",\"t17\":" + entry)), "tensor 't17' appears twice in the header");
  EXPECT_MENTIONS(parse_error(many_tensors(n, R"(,"x":{"dtype":"U8","shape":[1],"shape":[1],"data_offsets":[0,1]})")),
                  "key 'shape' appears twice in one header object ('x')");
  EXPECT_MENTIONS(parse_error(many_tensors(n, R"(,"x":{"dtype":"U8","shape":[1],"data_offsets":[0,1e999]})")),
                  "header is not valid JSON");
  EXPECT_MENTIONS(parse_error(many_tensors(n, R"(,"x":{"dtype":"U8","shape":[1],"data_offsets":[49999,50000]})")),
                  "'t49999' [49999, 50000) and 'x' [49999, 50000) overlap");
  EXPECT_MENTIONS(parse_error(many_tensors(n, R"(,"__metadata__":{"k":"v","k":"w"})")),
                  "key 'k' appears twice in one header object ('__metadata__')");
}

// ---- checkpoints ---------------------------------------------------------------------------

// Splits the golden file into two shards (alternating tensors) in `dir`;
// returns tensor name -> shard file name.
std::map<std::string, std::string> split_golden(const fs::path& dir) {
  const auto f = SafetensorsFile::open(kGolden);
  std::vector<TensorData> shard[2];
  std::map<std::string, std::string> map;
  for (size_t i = 0; i < f->tensors().size(); ++i) {
    const TensorView& t = f->tensors()[i];
    shard[i % 2].push_back({t.name, t.dtype, t.shape, t.bytes});
    map[t.name] = "model-0000" + std::to_string(i % 2 + 1) + "-of-00002.safetensors";
  }
  write_safetensors(dir / "model-00001-of-00002.safetensors", shard[0]);
  write_safetensors(dir / "model-00002-of-00002.safetensors", shard[1]);
  return map;
}

void write_index(const fs::path& dir, const std::map<std::string, std::string>& map) {
  const json index = {{"metadata", {{"total_size", 0}}}, {"weight_map", map}};
  std::ofstream(dir / "model.safetensors.index.json") << index.dump(1);
}

// Every tensor of the golden file is found in `ckpt` with the same bytes.
void expect_same_as_golden(const Checkpoint& ckpt) {
  const auto golden = SafetensorsFile::open(kGolden);
  ASSERT_EQ(ckpt.tensors().size(), golden->tensors().size());
  for (const TensorView& g : golden->tensors()) {
    const TensorView* t = ckpt.find(g.name);
    ASSERT_NE(t, nullptr) << g.name;
    EXPECT_EQ(t->shape, g.shape);
    EXPECT_EQ(t->dtype, g.dtype);
    EXPECT_TRUE(std::equal(t->bytes.begin(), t->bytes.end(), g.bytes.begin(), g.bytes.end())) << g.name;
  }
}

TEST(Checkpoint, SingleFile) {
  const Checkpoint c = Checkpoint::open(kGolden);
  expect_same_as_golden(c);
  EXPECT_EQ(c.files().size(), 1u);
  const auto all = c.tensors();
  EXPECT_TRUE(std::is_sorted(all.begin(), all.end(), [](auto* a, auto* b) { return a->name < b->name; }));
  EXPECT_EQ(c.find("missing"), nullptr);
}

TEST(Checkpoint, ShardedThroughIndex) {
  TempDir dir;
  const auto map = split_golden(dir.path());
  write_index(dir.path(), map);
  const Checkpoint c = Checkpoint::open(dir.path());
  EXPECT_EQ(c.files().size(), 2u);
  expect_same_as_golden(c);
  for (const auto& [name, shard] : map) EXPECT_EQ(fs::path(c.find(name)->file).filename(), shard) << name;
  expect_same_as_golden(Checkpoint::open(dir / "model.safetensors.index.json"));
}

TEST(Checkpoint, ShardedWithoutIndexOpensEveryFile) {
  TempDir dir;
  split_golden(dir.path());
  std::ofstream(dir / "notes.txt") << "not a tensor file";
  const Checkpoint c = Checkpoint::open(dir.path());
  ASSERT_EQ(c.files().size(), 2u);
  EXPECT_EQ(fs::path(c.files()[0]->origin()).filename(), "model-00001-of-00002.safetensors");
  expect_same_as_golden(c);
}

TEST(Checkpoint, IndexNamingMissingShard) {
  TempDir dir;
  auto map = split_golden(dir.path());
  map["layers.0.attn.attn_sink"] = "model-00003-of-00002.safetensors";
  write_index(dir.path(), map);
  const std::string msg = error_of([&] { Checkpoint::open(dir.path()); });
  EXPECT_MENTIONS(msg, "shard 'model-00003-of-00002.safetensors'");
  EXPECT_MENTIONS(msg, "does not exist");
}

TEST(Checkpoint, IndexMappingTensorToWrongShard) {
  TempDir dir;
  auto map = split_golden(dir.path());
  const std::string name = "layers.0.attn.attn_sink";
  map[name] = map[name] == "model-00001-of-00002.safetensors" ? "model-00002-of-00002.safetensors"
                                                              : "model-00001-of-00002.safetensors";
  write_index(dir.path(), map);
  const std::string msg = error_of([&] { Checkpoint::open(dir.path()); });
  EXPECT_MENTIONS(msg, "tensor '" + name + "' is mapped to '" + map[name] + "', which does not hold it");
}

TEST(Checkpoint, IndexErrors) {
  TempDir dir;
  auto map = split_golden(dir.path());
  std::ofstream(dir / "model.safetensors.index.json") << "{\"weight_map\": ";
  EXPECT_MENTIONS(error_of([&] { Checkpoint::open(dir.path()); }), "model.safetensors.index.json: not valid JSON");
  std::ofstream(dir / "model.safetensors.index.json") << "{\"weights\": {}}";
  EXPECT_MENTIONS(error_of([&] { Checkpoint::open(dir.path()); }), "'weight_map' object");
  std::ofstream(dir / "model.safetensors.index.json") << "{\"weight_map\": {}}";
  EXPECT_MENTIONS(error_of([&] { Checkpoint::open(dir.path()); }), "weight_map is empty");
  map["layers.0.attn.attn_sink"] = "../model-00001-of-00002.safetensors";
  write_index(dir.path(), map);
  EXPECT_MENTIONS(error_of([&] { Checkpoint::open(dir.path()); }), "not a file in the checkpoint directory");
}

TEST(Checkpoint, DuplicateTensorAcrossFiles) {
  TempDir dir;
  fs::copy_file(kGolden, dir / "a.safetensors");
  const Bytes sink(16, 0);
  write_safetensors(dir / "b.safetensors", {{"layers.0.attn.attn_sink", DType::kF32, {4}, sink}});
  const std::string msg = error_of([&] { Checkpoint::open(dir.path()); });
  EXPECT_MENTIONS(msg, "tensor 'layers.0.attn.attn_sink' appears in both");
  EXPECT_MENTIONS(msg, "a.safetensors");
  EXPECT_MENTIONS(msg, "b.safetensors");
}

TEST(Checkpoint, EmptyOrMissingPath) {
  TempDir dir;
  EXPECT_MENTIONS(error_of([&] { Checkpoint::open(dir.path()); }), "no .safetensors files");
  EXPECT_MENTIONS(error_of([&] { Checkpoint::open(dir / "nope"); }), "nope: no such file or directory");
}

}  // namespace
}  // namespace dsv4

namespace dsv4 {
namespace {

// ---- paths that are not regular files --------------------------------------------------------

TEST(Checkpoint, IndexEntryNamingADirectoryOrAFifo) {
  TempDir dir;
  auto map = split_golden(dir.path());
  fs::create_directory(dir / "shard-dir.safetensors");
  map["layers.0.attn.attn_sink"] = "shard-dir.safetensors";
  write_index(dir.path(), map);
  std::string msg = error_of([&] { Checkpoint::open(dir.path()); });
  EXPECT_MENTIONS(msg, "shard 'shard-dir.safetensors' (holding 'layers.0.attn.attn_sink') is a directory");
  ASSERT_EQ(mkfifo((dir / "shard-fifo.safetensors").c_str(), 0600), 0);
  map["layers.0.attn.attn_sink"] = "shard-fifo.safetensors";
  write_index(dir.path(), map);
  msg = error_of([&] { Checkpoint::open(dir.path()); });  // must not block on the FIFO
  EXPECT_MENTIONS(msg, "shard 'shard-fifo.safetensors' (holding 'layers.0.attn.attn_sink') is a FIFO");
  map["layers.0.attn.attn_sink"] = "nope.safetensors";
  write_index(dir.path(), map);
  EXPECT_MENTIONS(error_of([&] { Checkpoint::open(dir.path()); }), "shard 'nope.safetensors' (holding "
                                                                   "'layers.0.attn.attn_sink') does not exist");
}

TEST(Checkpoint, FifosAndDirectoriesNamedLikeTensorFiles) {
  TempDir dir;
  ASSERT_EQ(mkfifo((dir / "fifo.safetensors").c_str(), 0600), 0);
  std::string msg = open_error(dir / "fifo.safetensors");  // O_NONBLOCK: no writer needed to fail
  EXPECT_MENTIONS(msg, "fifo.safetensors: not a regular file (it is a FIFO");
  msg = error_of([&] { Checkpoint::open(dir / "fifo.safetensors"); });
  EXPECT_MENTIONS(msg, "is a FIFO");
  // A directory of shards: a FIFO among them is reported, not skipped or waited on.
  split_golden(dir.path());
  msg = error_of([&] { Checkpoint::open(dir.path()); });
  EXPECT_MENTIONS(msg, "fifo.safetensors: not a regular file (it is a FIFO");
  fs::remove(dir / "fifo.safetensors");
  fs::create_directory(dir / "sub.safetensors");
  EXPECT_MENTIONS(error_of([&] { Checkpoint::open(dir.path()); }), "sub.safetensors: not a regular file (it is a directory");
  fs::remove(dir / "sub.safetensors");
  // The index itself as a FIFO or a directory.
  ASSERT_EQ(mkfifo((dir / "model.safetensors.index.json").c_str(), 0600), 0);
  EXPECT_MENTIONS(error_of([&] { Checkpoint::open(dir.path()); }), "model.safetensors.index.json: is a FIFO");
  fs::remove(dir / "model.safetensors.index.json");
  fs::create_directory(dir / "model.safetensors.index.json");
  EXPECT_MENTIONS(error_of([&] { Checkpoint::open(dir.path()); }), "model.safetensors.index.json: is a directory");
}

TEST(Checkpoint, IndexWithRepeatedTensorNames) {
  TempDir dir;
  split_golden(dir.path());
  std::ofstream(dir / "model.safetensors.index.json")
      << R"({"weight_map": {"layers.0.attn.attn_sink": "model-00001-of-00002.safetensors",)"
      << R"( "layers.0.attn.attn_sink": "model-00002-of-00002.safetensors"}})";
  EXPECT_MENTIONS(error_of([&] { Checkpoint::open(dir.path()); }),
                  "key 'layers.0.attn.attn_sink' appears twice in object 'weight_map'");
}

}  // namespace
}  // namespace dsv4
