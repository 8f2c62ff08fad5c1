#include "model/json_reader.h"

#include "common/text.h"

#include <utility>
#include <vector>

namespace dsv4 {
namespace {

using json = nlohmann::json;

// Builds the DOM from SAX events. nlohmann's own callback parser would see
// the keys too, but it rescans the parent container whenever a child ends,
// which makes a header of n tensors cost O(n^2).
class Builder {
 public:
  Builder(const std::string& origin, size_t max_depth) : origin_(origin), max_depth_(max_depth) {}

  json take() { return std::move(root_); }

  bool null() { return put(nullptr); }
  bool boolean(bool v) { return put(v); }
  bool number_integer(json::number_integer_t v) { return put(v); }
  bool number_unsigned(json::number_unsigned_t v) { return put(v); }
  bool number_float(json::number_float_t v, const std::string&) { return put(v); }
  bool string(std::string& v) { return put(std::move(v)); }
  bool binary(json::binary_t& v) { return put(json::binary(std::move(v))); }
  bool start_object(size_t) { return open(json::object()); }
  bool start_array(size_t) { return open(json::array()); }
  bool end_object() { return close(); }
  bool end_array() { return close(); }

  bool key(std::string& k) {
    Level& top = open_.back();
    auto [it, fresh] = top.value->get_ref<json::object_t&>().try_emplace(k);
    if (!fresh) {
      const std::string container = path(open_.size() - 1);
      const std::string where = container.empty() ? "the top-level object" : "object '" + container + "'";
      fail(JsonParseError::Kind::kDuplicateKey, "key '" + shown(k) + "' appears twice in " + where, container, k, "");
    }
    top.key = k;
    top.slot = &it->second;
    return true;
  }

  template <class Exception>
  bool parse_error(size_t, const std::string&, const Exception& e) {
    const std::string p = path();
    fail(JsonParseError::Kind::kSyntax,
         std::string("invalid JSON") + (p.empty() ? "" : " at '" + p + "'") + ": " + e.what(), p, "", e.what());
    return false;
  }

 private:
  struct Level {
    json* value;           // the open object or array
    std::string key;       // objects: the last key read
    json* slot = nullptr;  // objects: where that key's value goes
  };


  // "a.b[3].c": the path through the first `levels` open containers to the
  // value being read (in the innermost one: its pending key or next element).
  std::string path(size_t levels) const {
    std::string p;
    for (size_t i = 0; i < levels && i < open_.size(); ++i) {
      const Level& l = open_[i];
      const bool innermost = i + 1 == open_.size();
      // (append, not chained +: GCC 12 warns falsely with -Wrestrict on the latter)
      if (l.value->is_object()) {
        if (!l.slot) continue;
        if (!p.empty()) p.push_back('.');
        p.append(shown(l.key));
      } else {
        const size_t n = l.value->size();
        if (!innermost && n == 0) continue;
        p.push_back('[');
        p.append(std::to_string(innermost ? n : n - 1));
        p.push_back(']');
      }
    }
    return p;
  }
  std::string path() const { return path(open_.size()); }

  [[noreturn]] void fail(JsonParseError::Kind kind, const std::string& what, std::string where, std::string key,
                         std::string detail) {
    throw JsonParseError(origin_ + ": " + what, kind, std::move(where), std::move(key), open_.size(),
                         std::move(detail));
  }

  // Places a value at the root, at the end of the open array, or under the last key.
  json* place(json&& v) {
    if (open_.empty()) {
      root_ = std::move(v);
      return &root_;
    }
    Level& top = open_.back();
    if (top.value->is_array()) {
      top.value->push_back(std::move(v));
      return &top.value->back();
    }
    *top.slot = std::move(v);
    return top.slot;
  }

  bool put(json&& v) {
    place(std::move(v));
    return true;
  }

  bool open(json&& container) {
    if (open_.size() >= max_depth_)
      fail(JsonParseError::Kind::kTooDeep, "nests deeper than " + std::to_string(max_depth_) + " levels", path(), "",
           "");
    // Pointers stay valid: a parent gets no new element while this child is open.
    open_.push_back({place(std::move(container)), {}, nullptr});
    return true;
  }

  bool close() {
    open_.pop_back();
    return true;
  }

  const std::string& origin_;
  size_t max_depth_;
  json root_;
  std::vector<Level> open_;
};

}  // namespace

nlohmann::json parse_json_text(std::string_view text, const std::string& origin, size_t max_depth) {
  Builder b(origin, max_depth);
  const bool ok = json::sax_parse(text.begin(), text.end(), &b);
  // A SAX parse that stops without an error event cannot happen (every handler
  // returns true or throws); keep the check so that a change shows.
  DSV4_REQUIRE(ok, origin + ": invalid JSON");
  return b.take();
}

int64_t json_integer(const nlohmann::json& v, const std::string& what, int64_t lo, int64_t hi) {
  if (v.is_number_float()) throw Error(what + " must be an exact integer (got " + v.dump() + ")");
  if (!v.is_number_integer()) {
    std::string text = v.dump();
    if (text.size() > 60) text = text.substr(0, 60) + "...";
    throw Error(what + " has the wrong type: expected an integer, got " + v.type_name() + " " + text);
  }
  // Parsed non-negative integers are stored unsigned (they may exceed int64).
  bool fits;
  if (v.is_number_unsigned()) {
    const uint64_t u = v.get<uint64_t>();
    fits = hi >= 0 && u <= uint64_t(hi) && (lo <= 0 || u >= uint64_t(lo));
  } else {
    const int64_t i = v.get<int64_t>();
    fits = i >= lo && i <= hi;
  }
  DSV4_REQUIRE(fits, what + " = " + v.dump() + " is out of range [" + std::to_string(lo) + ", " + std::to_string(hi) + "]");
  return v.get<int64_t>();
}

}  // namespace dsv4
