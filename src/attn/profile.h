#pragma once
// Numerics profiles (SPEC §5): `exact` computes in float32 everywhere with
// float32 caches and no quantization; `production` follows the deployed
// systems (bf16 activations, FP8 linears and KV, MXFP4/FP8 indexer).
#include <string_view>

namespace dsv4 {

enum class Profile { kExact, kProduction };

std::string_view profile_name(Profile p);
Profile parse_profile(std::string_view name);  // "exact" | "production"; throws Error

}  // namespace dsv4
