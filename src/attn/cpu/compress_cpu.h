#pragma once
// The compressor's CPU twin of the CUDA kernels (attn/cuda/compressor_cuda.h):
// compress_cpu runs CompressorParams (attn/compressor_params.h) on host
// pointers, bit for bit what compressor_cuda computes. The row, pooling and
// finishing helpers below are also what CompressorOp (attn/cpu/compressor.h,
// the CPU layer) runs, so the two CPU paths share one implementation. Only
// numerics and cache codecs below this file: no BLAS, no step metadata.
#include <cstddef>
#include <cstdint>

#include "attn/compressor_params.h"
#include "numerics/rope.h"

namespace dsv4 {

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
void compressor_encode(EntryFormat record, const float* v, int c, uint8_t* page, int B, int t);

// ---- the CPU twin of the CUDA compressor -------------------------------------

// Both phases of CompressorParams on host pointers: exactly what
// compressor_cuda computes, bit for bit, for the records it supports.
void compress_cpu(const CompressorParams& p);

// Phase 2's pooled vector (before any rounding) of token t, c floats; t must
// have entry_slot[t] >= 0. The rows of this step from its projection
// (pool::step_token), the others from the state cache as it is.
void compress_pool_cpu(const CompressorParams& p, int t, float* v);

}  // namespace dsv4
