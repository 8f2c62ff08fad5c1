#pragma once
// Internals shared by the host side (sparse_attention_cuda.cu), the plan,
// attention and combine kernels. Not part of the public API.
//
// Work decomposition. A "unit" is one (token, group of head blocks); unit
// u = token * plan_head_blocks + group. With an even number of 64-head
// blocks (H = 128) a group is a pair of blocks, run by the two CTAs of a
// cluster over the same tiles (each dequantizes half of every tile for
// both); otherwise a group is one block and one CTA. A unit's attended set (its SWA list,
// then its extra list) is cut into tiles of 64 entries; an empty unit still
// counts one tile so that it writes its zero output and -inf lse. The plan
// numbers all tiles of all units consecutively and gives work slot c (a CTA,
// or a cluster of two) the tiles [c * per, (c + 1) * per), per =
// ceil(total / slots) or more (or whole units per slot; see
// sparse_mla_plan.cu). A unit that falls wholly inside one slot's range is
// finished there; a unit cut by range boundaries ("split") gets one fp32
// partial per CTA and head block that touches it, and a second kernel, the
// combine (sparse_mla_combine.cu), merges them. Each CTA touches at most two
// split units: the first and the last of its range, which use partial slots
// 0 and 1.
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace dsv4::cuda {

inline constexpr int kTileEntries = 64;  // entries per tile
inline constexpr int kHeadBlock = 64;    // heads per unit
inline constexpr int kAttnThreads = 384;  // 3 warpgroups per CTA (S, V, producer: sparse_mla_tiles.cuh), one CTA per SM
inline constexpr int kPlanThreads = 1024;
inline constexpr int kMaxGrid = 1024;  // CTAs of the attention kernel the plan can address

struct CacheView {
  const uint8_t* base;
  int64_t capacity;        // num_pages * entries_per_page
  int64_t page_stride;     // bytes
  uint32_t entries_per_page;
  int page_shift;          // log2(entries_per_page) when a power of two (shift, not divide), else -1
};

struct ListView {
  const int32_t* indices;  // [num_tokens, width]
  const int32_t* lengths;  // [num_tokens]
  int width;
};

// One plan, in device memory.
struct PlanView {
  int4* unit_info;    // [units + 1]: {first tile, swa length, extra length, 0}; [units].x = total tiles
  int4* cta_work;     // [slots]: {first tile, end tile, first unit, tiles per slot}
  int* split_units;   // [slots]: the units cut by range boundaries (any order)
  int* split_count;   // [2]: how many; the most slots one of them spans
};

struct AttnParams {
  int num_tokens;
  int num_heads;
  int head_blocks;          // ceil(num_heads / 64)
  int cluster;              // CTAs per cluster: 2 (pairs of head blocks) or 1
  int plan_head_blocks;     // head_blocks / cluster: units per token
  const uint16_t* q;        // [num_tokens, num_heads, 512] bf16
  CacheView swa_cache;
  CacheView extra_cache;
  ListView swa;
  ListView extra;
  const float* sink;        // [num_heads]
  float scale_log2;         // softmax_scale * log2(e)
  uint16_t* out;            // [num_tokens, num_heads, 512] bf16
  float* lse;               // [num_tokens, num_heads] or null
  // The output path's inverse RoPE, fused into the output writes
  // (OutputRope): dims 448..511 of every head rotated, pair i of token t by
  // rope_cs[t * 32 + i] = (cos, -sin). Null: no rotation.
  const float2* rope_cs;
  PlanView plan;
  float* partial_o;         // [grid][2][64][512] unnormalised fp32 outputs (CTA c: slot c / cluster, head block c % cluster of the unit)
  float2* partial_ml;       // [grid][2][64] {running max (log2 units), sum of exp2}
  int grid;                 // CTAs of the attention kernel: work slots * cluster
  // The plan kernel only: tokens at and past *real_tokens (a device int;
  // null: none) are padding and get no units (SparseAttentionCuda::plan).
  const int32_t* real_tokens;
  // The decode kernel may read these lists' indices (not their records)
  // before its PDL wait: they were written before the step's plan kernel
  // (step metadata; sparse_attention_cuda.h: ListsReady).
  bool swa_ready;
  bool extra_ready;
  // And the records of those lists but their last num_tokens entries
  // (ListsReady::records): the decode kernel loads them before its wait.
  bool records_ready;
  // The tile kernel's CTAs let the combine (and wo_a's CTAs, which stream
  // weight stages before their wait) start only when they are done, not
  // right after their wait: on short rows that stream delayed the tiles'
  // record loads (8 x 4K 0.8-1.0% faster, 8 x 64K 0.5%: runs BD1, BD5); a
  // long row's tiles (C128A at 1M) were 0.4% slower that way, so rows wider
  // than kDecodeMaxEntries keep the early start.
  bool late_trigger;
  // Diagnostics for the benchmark only (null in normal use): per CTA,
  // kDebugSlots zero-initialised entries (kDebug* below), in nanoseconds.
  unsigned long long* debug_clock;
};

inline constexpr int kDebugSlots = 16;
inline constexpr int kDebugStart = 0;         // %globaltimer at the CTA's start
inline constexpr int kDebugConsumerWait = 1;  // time S waited for a tile's K (all writers, both CTAs of a pair)
inline constexpr int kDebugProducerWait = 2;  // time the producer waited for a free K buffer
inline constexpr int kDebugEnd = 3;           // %globaltimer at the end of the tile loop
inline constexpr int kDebugSPFree = 4;        // time S waited for V to free P
inline constexpr int kDebugVPReady = 5;       // time V waited for S's P
inline constexpr int kDebugVEmpty = 6;        // time V waited for a free K buffer
inline constexpr int kDebugVStage = 7;        // time V waited for its staged records (cp.async)
// The CTA's first tile, %globaltimer when each step ended (the chain of
// one tile at batch 1): S had Q in shared memory, the producer signalled
// its rows, S's wait for K returned, S's Q K^T, S handed P to V, S's P V;
// and when S last stored a unit's outputs or partials.
inline constexpr int kDebugQReady = 8;
inline constexpr int kDebugProducerFull = 9;
inline constexpr int kDebugFirstK = 10;
inline constexpr int kDebugFirstS = 11;
inline constexpr int kDebugFirstP = 12;
inline constexpr int kDebugFirstPV = 13;
inline constexpr int kDebugFinish = 14;
// The decode kernel's stamps (%globaltimer, per CTA in grid order).
inline constexpr int kDecodeEntry = 0;   // the CTA started
inline constexpr int kDecodeWaited = 1;  // its PDL wait returned
inline constexpr int kDecodeStored = 2;  // the first chunk's K rows and Q in shared memory
inline constexpr int kDecodeLooped = 3;  // every chunk done
inline constexpr int kDecodeMerging = 4; // the splits' O and statistics visible (cluster barrier)
inline constexpr int kDecodeWritten = 5; // this CTA's outputs written

// The decode kernel (sparse_mla_decode.cu): rows of at most
// kDecodeMaxEntries entries cut into at most kDecodeMaxSplits splits of a
// cluster. Instantiations of 4, 8 and 16 warps run chunks of 8 entries a
// warp: up to 4, 2 and 1 chunks a split.
inline constexpr int kDecodeMaxSplits = 8;  // the portable cluster size
inline constexpr int kDecodeMaxEntries = 1024;
constexpr int decode_chunk(int warps) { return 8 * warps; }
// Raises its dynamic shared-memory limit: 0, or -cudaError_t.
int decode_attention_prepare();
// Grid (splits, ceil(heads / 16), tokens) of CTAs of `warps` warps (4, 8 or
// 16); reads the row lengths from p.plan (a plan for the same call), so it
// runs after plan() like the tile kernel.
void launch_decode_attention(const AttnParams& p, int splits, int warps, cudaStream_t stream);

// Raises the attention kernel's dynamic shared-memory limit and returns how
// many of its CTAs (in clusters of `cluster`, 1 or 2) are resident at once
// on this device, or -cudaError_t.
int attention_grid(int cluster);
void launch_plan(const AttnParams& p, cudaStream_t stream);
// The attention kernel, then the combine of split units (programmatic
// dependent launch: it starts while the attention kernel runs and always
// waits for it to complete before it exits).
void launch_attention(const AttnParams& p, cudaStream_t stream);
void launch_combine(const AttnParams& p, cudaStream_t stream);

}  // namespace dsv4::cuda
