#pragma once
// The compressor of SPEC §4.3 on the CPU. Every token's row [a | g + ape] goes
// to the compressor-state cache at its own position; a token that completes a
// block (slot j complete at position j*m + m - 1) pools the rows of its block
// (and, for m = 4, of the block before) into compressed entry j, which is
// normalized, rotated (RoPE at position j*m) and written to its cache.
//
// CompressorOp is the CPU layer's compressor (projections included, caches
// as PageStores); it shares the row, pooling and finishing code with
// compress_cpu, the CPU twin of the CUDA kernels (attn/cpu/compress_cpu.h).
#include <cstdint>
#include <vector>

#include "attn/cpu/compress_cpu.h"
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

}  // namespace dsv4
