#include "attn/profile.h"

#include <string>

#include "common/error.h"

namespace dsv4 {

std::string_view profile_name(Profile p) { return p == Profile::kExact ? "exact" : "production"; }

Profile parse_profile(std::string_view name) {
  if (name == "exact") return Profile::kExact;
  if (name == "production") return Profile::kProduction;
  throw Error("unknown profile '" + std::string(name) + "' (expected exact or production)");
}

}  // namespace dsv4
