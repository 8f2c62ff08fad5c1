#pragma once
// Untrusted text (tensor names, JSON keys from a file) as it appears inside
// an error message: at most 200 bytes, and control bytes (NUL included,
// which would cut a message short) written as \xNN.
#include <cstdio>
#include <string>
#include <string_view>

namespace dsv4 {

inline std::string shown(std::string_view text) {
  constexpr size_t kMax = 200;
  std::string out;
  for (size_t i = 0; i < text.size() && i < kMax; ++i) {
    const unsigned char c = static_cast<unsigned char>(text[i]);
    if (c >= 0x20 && c != 0x7f) {
      out.push_back(char(c));
      continue;
    }
    char buf[5];
    std::snprintf(buf, sizeof buf, "\\x%02x", c);
    out += buf;
  }
  if (text.size() > kMax) out += "...";
  return out;
}

}  // namespace dsv4
