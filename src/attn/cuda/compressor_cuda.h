#pragma once
// The compressor (SPEC §4.3, §5, §6) on the GPU: CompressorParams
// (attn/compressor_params.h) with device pointers (except `rope`, a host
// object whose 32 frequencies are passed by value). Two kernels:
//   1. state rows: every token's [a | g + ape[pos % m]] into the state cache;
//   2. entries: every token with entry_slot >= 0 pools its slot from the
//      state rows (attn/compressor_math.h, the CPU's code), finishes it (bf16,
//      RMSNorm, bf16, RoPE at j*m, bf16, optional Hadamard + bf16) and writes
//      the fp8_ds_mla or indexer-key record.
// compress_cpu (attn/cpu/compress_cpu.h) is the CPU twin: same params, same
// bits (see fused_common.cuh for the two rare exceptions). Production
// numerics only (bf16_rounding), no kF32 records.
//
// Launch only (CUDA-graph capturable); bad parameters throw Error before
// anything launches.
#include "attn/compressor_params.h"

struct CUstream_st;  // cudaStream_t without the CUDA headers

namespace dsv4::cuda {

void compressor_cuda(const CompressorParams& p, CUstream_st* stream);

// The checks compressor_cuda runs first (check_compressor_params plus the
// GPU's own); throws Error naming the problem.
void check_compressor_cuda_params(const CompressorParams& p);

}  // namespace dsv4::cuda
