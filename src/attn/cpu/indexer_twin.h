#pragma once
// The CPU twins of the CUDA indexer ops (attn/cuda/indexer_*_cuda.h): the
// flat production ops of attn/indexer_params.h on host pointers, same inputs,
// same bits. Numerics only (no BLAS, no model or runtime headers), so GPU
// tests that compare against them build into self-contained binaries.
// IndexerOp (attn/cpu/indexer.h) runs them behind the layer's interface.
#include <cstdint>

#include "attn/indexer_params.h"

namespace dsv4 {

// Op 1: quantized query records and head weights.
void indexer_queries_cpu(const IndexerQueryParams& p);

// Scores of keys j in [0, n) for token t of run `run` (NaN where a key has no
// page): the arithmetic of op 2.
void indexer_scores_cpu(const IndexerQueries& q, int t, const BlockTableView& table, int run, const KvPages& keys,
                        int64_t n, float* scores);

// Op 2: picks, global slots and lengths. Keys are scored in tiles of
// `key_tile` per run; each token keeps only its best k so far (memory
// O(tile + T * k) at any context length).
void indexer_select_cpu(const IndexerSelectParams& p, int key_tile = 2048);

}  // namespace dsv4
