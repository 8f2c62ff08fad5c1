#pragma once
// Internals of the CUDA indexer selection (indexer_select_cuda.h): the work
// plan built on the device, the workspace, and the three kernels' launchers.
//
//  plan      (1 CTA)   groups the step's tokens (up to 4 consecutive
//                      positions of one run, aligned to 4, so they see the
//                      same keys; or, when the host says the step has one
//                      token per run, each token alone) and cuts each
//                      group's key tiles (a tile = a page = 64 keys) into
//                      units, so that the units carry about equal work and
//                      number about one per multiprocessor (each unit
//                      ends in a list of k keys: fewer units, less of it).
//  score     (1 CTA/SM, persistent) takes units in turn: scores the unit's
//                      tiles for the group's tokens on the tensor cores,
//                      streams a running top-k per token, and writes each
//                      token's best k of the unit as a list of order keys.
//                      Two kernels: 2 warpgroups for groups of up to 4
//                      tokens, 4 for one-token groups (indexer_score.cu).
//  finalize  (1 CTA per token) selects the best k of the token's lists,
//                      sorts them best first and writes picks, slots, lengths.
//  short     (run_short: a decode step of short rows) scores and selects
//                      in one kernel, a cluster of CTAs a token, no plan
//                      and no lists (indexer_short.cu).
// List bounds: when a token has more keys than finalize stages in shared
// memory, each of its S lists also records the m-th best key of its unit,
// m = ceil(k / S) (0 when the unit has fewer than m keys). Every list then
// holds m keys at or above the smallest bound t, so S * m >= k keys are
// >= t and the token's k-th best key is >= t. Such lists are written
// sorted best first, so finalize reads of each list only the prefix at or
// above t (at long context a small part of each list) and selects among
// the few keys read.
// Memory: the lists, (4 * units target + max_tokens) * topk keys, fixed at
// construction whatever the context length (SPEC §9).
#include <cuda_runtime.h>

#include <cstdint>

#include "attn/indexer_params.h"

namespace dsv4::cuda::ix {

inline constexpr int kTileKeys = 64;     // keys per tile = entries per key page
inline constexpr int kGroupTokens = 4;   // tokens scored together (one wgmma N = 64 heads each)
inline constexpr int kHeads = 64;        // the scorer's query heads (V4: index_n_heads = 64)
inline constexpr int kPlanThreads = 1024;
// The plan's fewest tiles a unit for groups of up to 4 tokens (the score
// kernel's general shape runs three warpgroups; the third may find no tile
// in a unit of two), and the decode shape's warpgroups, which are also its
// fewest tiles a unit (groups of one token).
inline constexpr int kGeneralMinUnitTiles = 2;
inline constexpr int kDecodeWarpgroups = 4;
inline constexpr int kFinalizeThreads = 512;
inline constexpr int kFinalizeStageKeys = 3072;  // candidates finalize holds in shared memory
inline constexpr int kMaxGroupUnits = 128;       // Workspace::max_group_units (finalize keeps their counts in shared memory)

struct Group {
  int32_t run, first, count, tiles;  // tokens first .. first + count - 1; key tiles 0 .. tiles - 1
  int32_t units, unit_base, list_base, pad;
};
// Tiles [tile_begin, tile_end) of a group; its lists are list_base + split * count + tl.
struct Unit {
  int32_t group, tile_begin, tile_end, split;
};
struct TokenRef {
  int32_t group, tl;  // group -1: nothing to select (padding)
};
struct Counters {
  int32_t units, next_unit, groups, lists;
};

struct Workspace {
  Group* groups = nullptr;      // [max_tokens]
  TokenRef* tokens = nullptr;   // [max_tokens]
  Unit* units = nullptr;        // [max_units]
  Counters* counters = nullptr;
  uint64_t* list_keys = nullptr;  // [max_lists, topk]
  int32_t* list_counts = nullptr; // [max_lists]
  uint64_t* list_bounds = nullptr; // [max_lists], for groups where has_list_bounds
  int max_units = 0, max_lists = 0;
  int target_units = 0;    // about this many units per call (balanced work)
  int max_group_units = 1; // most units per group (its tokens' lists are merged by one CTA)
  int list_stride = 0;     // keys per list (the limits' topk)
};

// Index of the list of the group's token tl written by the unit of split
// `split` (its lists follow the group's list_base, a unit's tokens together).
__device__ __forceinline__ int64_t list_index(const Group& g, int split, int tl) {
  return int64_t(g.list_base) + int64_t(split) * g.count + tl;
}

// Whether the score kernel writes the group's list bounds (see above): more
// than one list and more keys than finalize can stage.
__device__ __forceinline__ bool has_list_bounds(const Group& g) {
  return g.units > 1 && int64_t(g.tiles) * kTileKeys > kFinalizeStageKeys;
}

struct SelectArgs {
  IndexerSelectParams p;
  Workspace ws;
  bool solo = false;  // one token per group (plan), scored by the decode kernel (score)
};

// Once per process: raises the score kernels' shared-memory limit.
void prepare_score_kernels();

void launch_plan(const SelectArgs& a, cudaStream_t stream);
// score_only (benchmarks): scores without the running top-k (empty lists).
void launch_score(const SelectArgs& a, int grid, bool score_only, cudaStream_t stream);
void launch_finalize(const SelectArgs& a, cudaStream_t stream);
// The short decode step's kernel (indexer_short.cu), and once per process its shared-memory limit.
void prepare_short_kernels();
void launch_short(const IndexerSelectParams& p, cudaStream_t stream);

}  // namespace dsv4::cuda::ix
