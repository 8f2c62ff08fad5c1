#pragma once
// Validators for numeric options that check the text before CLI11 converts
// it, so that a negative seed, an out-of-range count or a non-number gets a
// message with readable bounds (CLI11's own ranges print the largest double
// in full and let some conversions wrap); and a note both run and verify give.
#include <cstdint>

#include <CLI/CLI.hpp>

namespace dsv4::cli {

// A decimal integer in [lo, hi] ("0x10", "1e3", "12abc" and "+5" are refused).
CLI::Validator integer_in(int64_t lo, int64_t hi);
// A decimal integer in [0, 2^64 - 1] (seeds); a minus sign is refused.
CLI::Validator any_uint64();
// A finite number >= lo.
CLI::Validator number_at_least(double lo);
// A finite number > 0, or "inf".
CLI::Validator rate_or_inf();

// A memory size: a number of bytes with an optional K, M, G or T suffix
// (powers of 1024; "1.5G" is allowed, "2.5" is not: bytes come whole, and
// the unit was more likely forgotten). Returns -1 when `s` is none.
int64_t parse_size(const std::string& s);
// The same, as a validator (sizes of at least one byte).
CLI::Validator memory_size();

// Says on stderr that --index-keys changes nothing in the exact profile
// (its caches, indexer keys included, are float32).
void note_index_keys_unused_in_exact();

}  // namespace dsv4::cli
