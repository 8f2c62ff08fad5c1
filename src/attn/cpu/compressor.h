#pragma once
// The compressor of SPEC §4.3 in the CPU layer: the two projections (wkv,
// wgate: float32 on the bf16 weights), then compress_cpu (attn/cpu/
// compress_cpu.h, the CUDA kernels' twin): every token's row [a | g + ape]
// goes to the compressor-state cache at its own position; a token that
// completes a block (slot j complete at position j*m + m - 1) pools the rows
// of its block (and, for m = 4, of the block before) into compressed entry j,
// normalized, rotated (RoPE at position j*m) and written to its cache.
#include <cstdint>
#include <vector>

#include "attn/cpu/compress_cpu.h"
#include "attn/cpu/linear.h"
#include "attn/cpu/scratch.h"
#include "cache/entries.h"
#include "numerics/rope.h"
#include "step/step_layout.h"

namespace dsv4 {

// Where one compressor reads and writes, per step.
struct CompressorIo {
  EntryArena state;                      // state rows
  BlockTableView state_table;            // per run: the state rows' pages
  const int32_t* state_slots = nullptr;  // [T] row slot of each token
  EntryArena out;                        // compressed entries
  const int32_t* out_slots = nullptr;    // [T] entry a token completes, or -1
};

class CompressorOp {
 public:
  // `index_keys`: this is the indexer's compressor; production rotates its
  // entries with the Hadamard transform before they are quantized.
  CompressorOp(const CompressorWeights& w, Profile profile, bool cache_weights, const Rope& rope, float eps,
               bool index_keys);

  // Returns the tokens (step-local indices) that completed an entry.
  std::vector<int> forward(const StepView& s, const float* x, const CompressorIo& io, CpuScratch& ws) const;
  int64_t copy_bytes() const { return wkv_.copy_bytes() + wgate_.copy_bytes(); }

 private:
  const CompressorWeights& w_;
  Profile profile_;
  const Rope& rope_;
  float eps_;
  bool index_keys_;
  Linear wkv_, wgate_;
};

}  // namespace dsv4
