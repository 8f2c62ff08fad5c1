#include "cli/options.h"

#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <string>

namespace dsv4::cli {
namespace {

// Parses the whole of `s` as T (decimal), or fails.
template <typename T>
bool parse_all(const std::string& s, T& out) {
  const char* end = s.data() + s.size();
  const auto [ptr, ec] = std::from_chars(s.data(), end, out);
  return ec == std::errc() && ptr == end && !s.empty();
}

std::string shown(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g", v);
  return buf;
}

std::string bounds(int64_t lo, int64_t hi) { return "[" + std::to_string(lo) + ", " + std::to_string(hi) + "]"; }

}  // namespace

CLI::Validator integer_in(int64_t lo, int64_t hi) {
  return CLI::Validator(
      [lo, hi](std::string& s) -> std::string {
        int64_t v = 0;
        if (!parse_all(s, v) || v < lo || v > hi) return "'" + s + "' is not an integer in " + bounds(lo, hi);
        return "";
      },
      "INT in " + bounds(lo, hi));
}

CLI::Validator any_uint64() {
  return CLI::Validator(
      [](std::string& s) -> std::string {
        uint64_t v = 0;
        if (!parse_all(s, v))
          return "'" + s + "' is not an integer in [0, " + std::to_string(std::numeric_limits<uint64_t>::max()) + "]";
        return "";
      },
      "UINT64");
}

int64_t parse_size(const std::string& s) {
  if (s.empty()) return -1;
  double scale = 1;
  std::string digits = s;
  switch (s.back()) {
    case 'K': case 'k': scale = 1024.0; break;
    case 'M': case 'm': scale = 1024.0 * 1024; break;
    case 'G': case 'g': scale = 1024.0 * 1024 * 1024; break;
    case 'T': case 't': scale = 1024.0 * 1024 * 1024 * 1024; break;
    default: break;
  }
  if (scale > 1) digits.pop_back();
  char* end = nullptr;
  const double v = digits.empty() ? NAN : std::strtod(digits.c_str(), &end);
  if (digits.empty() || end != digits.c_str() + digits.size() || !std::isfinite(v) || v < 0) return -1;
  const double bytes = v * scale;
  if (bytes >= 9.0e18 || (scale == 1 && bytes != std::floor(bytes))) return -1;
  return int64_t(bytes);
}

CLI::Validator memory_size() {
  return CLI::Validator(
      [](std::string& s) -> std::string {
        if (parse_size(s) < 1) return "'" + s + "' is not a memory size (whole bytes, or a number with K, M, G or T)";
        return "";
      },
      "SIZE");
}

CLI::Validator number_at_least(double lo) {
  return CLI::Validator(
      [lo](std::string& s) -> std::string {
        char* end = nullptr;
        const double v = s.empty() ? NAN : std::strtod(s.c_str(), &end);
        if (s.empty() || end != s.c_str() + s.size() || !std::isfinite(v) || v < lo)
          return "'" + s + "' is not a finite number >= " + shown(lo);
        return "";
      },
      "NUMBER >= " + shown(lo));
}

CLI::Validator rate_or_inf() {
  return CLI::Validator(
      [](std::string& s) -> std::string {
        if (s == "inf") return "";
        char* end = nullptr;
        const double v = s.empty() ? NAN : std::strtod(s.c_str(), &end);
        if (s.empty() || end != s.c_str() + s.size() || !std::isfinite(v) || v <= 0)
          return "'" + s + "' is not a number > 0 or inf";
        return "";
      },
      "NUMBER > 0 or inf");
}

void note_index_keys_unused_in_exact() {
  std::fprintf(stderr, "note: --index-keys is for production numerics; the exact profile keeps float32 indexer keys\n");
}

}  // namespace dsv4::cli
