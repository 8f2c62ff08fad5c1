#pragma once
// CUDA op 1 of the lightning indexer (attn/indexer_params.h): quantized query
// records and head weights from the indexer wq_b output (bf16) and the
// weights_proj output (fp32), bit for bit what indexer_queries_cpu writes.
// Every pointer of the params is a DEVICE pointer. One CTA per token; only a
// launch (no allocation, no synchronisation), so it can be captured in a CUDA
// graph; rows of tokens t >= *real_tokens are neither read nor written.
// Host-side problems throw Error before the launch; a launch error throws too.
#include "attn/indexer_params.h"

struct CUstream_st;  // cudaStream_t without the CUDA headers

namespace dsv4 {

void indexer_queries_cuda(const IndexerQueryParams& p, CUstream_st* stream);

// The checks indexer_queries_cuda does before launching (check_indexer_query_params
// plus the kernel's alignment needs); throws Error naming the problem.
void check_indexer_queries_cuda_params(const IndexerQueryParams& p);

}  // namespace dsv4
