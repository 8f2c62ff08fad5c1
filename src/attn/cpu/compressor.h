#pragma once
// The compressor of SPEC §4.3 on the CPU. Every token's row [a | g + ape] goes
// to the compressor-state cache at its own position; a token that completes a
// block (slot j complete at position j*m + m - 1) pools the rows of its block
// (and, for m = 4, of the block before) into compressed entry j, which is
// normalized, rotated (RoPE at position j*m) and written to its cache.
//
// Two entry points share the row, pooling and finishing code below:
// CompressorOp (the CPU layer: projections included, caches as PageStores)
// and compress_cpu (the CPU twin of the CUDA kernels: CompressorParams on
// host pointers, the projections given).
#include <cstdint>
#include <vector>

#include "attn/compressor_params.h"
#include "attn/cpu/linear.h"
#include "cache/cache_manager.h"
#include "numerics/rope.h"
#include "runtime/step.h"

namespace dsv4 {

// Where one compressor reads and writes, per step.
struct CompressorIo {
  PageStore* state = nullptr;                               // state rows
  CacheGroup state_group = CacheGroup::kC4AState;
  const std::vector<int32_t>* state_slots = nullptr;        // [T] row slot of each token
  const std::vector<std::vector<int32_t>>* state_tables = nullptr;  // per run
  PageStore* out = nullptr;                                 // compressed entries
  const std::vector<int32_t>* out_slots = nullptr;          // [T] entry a token completes, or -1
};

class CompressorOp {
 public:
  // `index_keys`: this is the indexer's compressor; production rotates its
  // entries with the Hadamard transform before they are quantized.
  CompressorOp(const CompressorWeights& w, Profile profile, bool cache_weights, const Rope& rope, float eps,
               bool index_keys);

  // Returns the tokens (step-local indices) that completed an entry.
  std::vector<int> forward(const StepMetadata& s, const float* x, const CompressorIo& io) const;

 private:
  // Pools slot j from the state rows; writes c floats.
  void pool(int run, int64_t slot_j, const CompressorIo& io, std::vector<float>& rows, float* v) const;

  const CompressorWeights& w_;
  Profile profile_;
  const Rope& rope_;
  float eps_;
  bool index_keys_;
  Linear wkv_, wgate_;
};

// ---- shared by CompressorOp and compress_cpu ---------------------------------

// A token's state row: row[i] = a[i], row[kc + i] = g[i] + ape_row[i], i < kc.
void compressor_state_row(const float* a, const float* g, const float* ape_row, int kc, float* row);

// Pools slot j (c channels) from its rows: rows[i] is the row of position
// pool::pool_first(j, m) + i, i < pool::pool_count(j, m), nullptr when absent.
void compressor_pool(const float* const* rows, int64_t slot_j, int m, int c, float* v);

// Turns a pooled vector into compressed entry j: with bf16_rounding, bf16
// before and after RMSNorm(norm) and after RoPE (position j*m, last 64 dims);
// then, with hadamard, the Hadamard rotation and bf16 (SPEC §5).
void compressor_finish(float* v, int c, const float* norm, float eps, const Rope& rope, int64_t rope_pos,
                       bool bf16_rounding, bool hadamard);

// Encodes a finished entry (c floats) as `record` into entry t of a page of B entries.
void compressor_encode(CompressedRecord record, const float* v, int c, uint8_t* page, int B, int t);

// ---- the CPU twin of the CUDA compressor -------------------------------------

// Both phases of CompressorParams on host pointers: exactly what
// compressor_cuda computes, bit for bit, for the records it supports.
void compress_cpu(const CompressorParams& p);

// Phase 2's pooled vector (before any rounding) of token t, c floats; t must
// have entry_slot[t] >= 0. Reads the state cache as it is.
void compress_pool_cpu(const CompressorParams& p, int t, float* v);

}  // namespace dsv4
