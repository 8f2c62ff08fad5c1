// The strict JSON reader (model/json_reader.h): the DOM it builds, repeated
// keys, depth, errors that name their place, exact integers, and time linear
// in the number of keys.
#include "model/json_reader.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <string>

#include "support/error_of.h"
#include "support/timing.h"

namespace dsv4 {
namespace {

using json = nlohmann::json;
using dsv4::test::error_of;


std::string parse_error(const std::string& text, size_t depth = 64) {
  return error_of([&] { parse_json_text(text, "t.json", depth); });
}

TEST(JsonReader, BuildsTheSameDomAsTheLibrary) {
  const std::string text =
      R"({"a": [1, -2, 3.5, "x", true, false, null, {"b": []}, [[]]], "": {}, "big": 18446744073709551615,)"
      R"( "neg": -9223372036854775808, "u": "\u00e9\ud83d\ude00", "nested": {"c": {"d": [{"e": 1}]}}})";
  const json ours = parse_json_text(text, "t.json");
  const json lib = json::parse(text);
  EXPECT_EQ(ours, lib) << ours.dump() << "\nvs\n" << lib.dump();
  EXPECT_TRUE(ours.at("big").is_number_unsigned());
  for (const char* scalar : {"1", "-0", "\"s\"", "null", "[]", "{}", "1e300"})
    EXPECT_EQ(parse_json_text(scalar, "t.json"), json::parse(scalar)) << scalar;
}

TEST(JsonReader, RepeatedKeysAreErrorsNamingTheObject) {
  std::string e = parse_error(R"({"a": 1, "b": 2, "a": 3})");
  EXPECT_MENTIONS(e, "t.json: key 'a' appears twice in the top-level object");
  e = parse_error(R"({"x": [0, {"k": 1, "k": 1}]})");
  EXPECT_MENTIONS(e, "key 'k' appears twice in object 'x[1]'");
  try {
    parse_json_text(R"({"x": {"y": {"k": 1, "k": 2}}})", "t.json");
    ADD_FAILURE() << "no error";
  } catch (const JsonParseError& err) {
    EXPECT_EQ(err.kind, JsonParseError::Kind::kDuplicateKey);
    EXPECT_EQ(err.key, "k");
    EXPECT_EQ(err.path, "x.y");
    EXPECT_EQ(err.depth, 3u);
  }
  // The same key in different objects is fine.
  EXPECT_NO_THROW(parse_json_text(R"({"a": {"k": 1}, "b": {"k": 1}, "k": [{"k": 1}, {"k": 2}]})", "t.json"));
}

TEST(JsonReader, ErrorsNameWhereTheyHappen) {
  std::string e = parse_error(R"({"config": {"rope_theta": 1e999}})");
  EXPECT_MENTIONS(e, "t.json: invalid JSON at 'config.rope_theta'");
  EXPECT_MENTIONS(e, "number overflow");
  e = parse_error(R"({"requests": [{"calls": []}, {"calls": [{"len": -1e400}]}]})");
  EXPECT_MENTIONS(e, "at 'requests[1].calls[0].len'");
  EXPECT_MENTIONS(parse_error("[1, 2, 1e999]"), "at '[2]'");
  EXPECT_MENTIONS(parse_error("{\"a\": tru}"), "invalid JSON at 'a'");
  EXPECT_MENTIONS(parse_error("{\"a\": 1} x"), "invalid JSON");
  EXPECT_MENTIONS(parse_error(""), "invalid JSON");
  EXPECT_MENTIONS(parse_error("{\"a\xff\": 1}"), "invalid JSON");
  // Depth: `depth` containers may be open, not one more.
  EXPECT_NO_THROW(parse_json_text(std::string(16, '[') + std::string(16, ']'), "t.json", 16));
  e = parse_error(std::string(17, '[') + std::string(17, ']'), 16);
  EXPECT_MENTIONS(e, "nests deeper than 16 levels");
  // A hostile depth is refused before it builds anything deep.
  EXPECT_MENTIONS(parse_error(std::string(1000000, '['), 64), "nests deeper than 64 levels");
}

TEST(JsonReader, ExactIntegers) {
  auto value = [](const char* text) { return json::parse(text); };
  EXPECT_EQ(json_integer(value("42"), "f", 0, 100), 42);
  EXPECT_EQ(json_integer(value("-5"), "f", -5, 5), -5);
  EXPECT_EQ(json_integer(value("9223372036854775807"), "f", 0, INT64_MAX), INT64_MAX);
  EXPECT_EQ(json_integer(value("-9223372036854775808"), "f", INT64_MIN, 0), INT64_MIN);
  auto error = [](const json& v, int64_t lo, int64_t hi) { return error_of([&] { json_integer(v, "x.json: field 'f'", lo, hi); }); };
  EXPECT_MENTIONS(error(value("256.7"), 0, 1000), "x.json: field 'f' must be an exact integer (got 256.7)");
  EXPECT_MENTIONS(error(value("256.0"), 0, 1000), "must be an exact integer");
  EXPECT_MENTIONS(error(value("true"), 0, 1000), "field 'f' has the wrong type: expected an integer, got boolean true");
  EXPECT_MENTIONS(error(value("\"7\""), 0, 1000), "got string \"7\"");
  EXPECT_MENTIONS(error(value("4294967552"), 0, 2147483647), "field 'f' = 4294967552 is out of range [0, 2147483647]");
  EXPECT_MENTIONS(error(value("18446744073709551615"), 0, INT64_MAX), "is out of range");
  EXPECT_MENTIONS(error(value("-1"), 0, 10), "field 'f' = -1 is out of range [0, 10]");
  EXPECT_MENTIONS(error(value("3"), 5, 10), "= 3 is out of range [5, 10]");
  EXPECT_MENTIONS(error(value("7"), -10, -1), "is out of range [-10, -1]");
}

// An object of n small objects: the shape of a safetensors header.
std::string many_objects(int n) {
  std::string text = "{";
  for (int i = 0; i < n; ++i) {
    if (i) text.push_back(',');
    text.append("\"layers.").append(std::to_string(i)).append(".w\":{\"dtype\":\"U8\",\"shape\":[1]}");
  }
  return text + "}";
}

TEST(JsonReader, TimeIsLinearInTheNumberOfEntries) {
  // 8x the entries: ~8x the time when linear (n log n for the map), 64x when
  // each entry rescans its parent, as nlohmann's callback parser does.
  const std::string small_text = many_objects(10000), large_text = many_objects(80000);
  const auto parse = [](const std::string& text, size_t n) { EXPECT_EQ(parse_json_text(text, "t.json").size(), n); };
  const auto [small, large] =
      dsv4::test::fastest_in_turn([&] { parse(small_text, 10000); }, [&] { parse(large_text, 80000); });
  // 40x: a margin for a busy machine (safetensors' twin of this test went
  // from 16x idle to 25x beside a build); a rescan per entry is 64x.
  EXPECT_LT(large, 40 * small) << "10k entries: " << small << " s, 80k entries: " << large << " s";
}

}  // namespace
}  // namespace dsv4
