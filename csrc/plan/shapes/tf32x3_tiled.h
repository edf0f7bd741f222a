// The tf32x3_tiled kernel's constants and the plan (column shares, weight
// stream and shared-memory layout) the host computes for it.
#pragma once

#include "../../common/host_device.h"
#include "../../common/sizes.h"

namespace ddpm_ops {
namespace shapes {

constexpr int kTileThreads = 256;          // 8 warps
constexpr int kTileWarps = kTileThreads / 32;
// Each warp computes all rows x up to kTileMaxWarpTiles mma tiles of 8
// output columns; a layer's pass covers kTileWarps times that.
constexpr int kTileMaxWarpTiles = 4;
constexpr int kTileMaxPassCols = kTileWarps * 8 * kTileMaxWarpTiles;
// Inner-dimension chunk per stage slot: one 128-byte row per output column,
// its eight 16-byte units stored in the order unit ^ (column % 8) (the TMA
// unit's 128-byte swizzle, which cp.async copies follow too), so that the
// eight rows an ldmatrix reads at one k fall in eight different bank groups.
constexpr int kTileKChunk = 32;
constexpr int kTileStageLd = kTileKChunk;
constexpr int kTileSwizzleBytes = 1024;  // the swizzle repeats every 8 rows; slots start on it
// The weight stream's ring: room for two chunks of the widest pass, or for
// more chunks of narrower passes (more copies in flight).
constexpr int kTileStageFloats = 2 * kTileMaxPassCols * kTileStageLd;
constexpr int kTileMaxSlots = 8;
// Float offset of element k of row n in a slot.
DDPM_HD inline int stage_index(int n, int k) {
  return n * kTileStageLd + ((((k >> 2) ^ n) & 7) << 2) + (k & 3);
}


struct TilePlan {
  int cluster_size;    // CTAs sharing one row tile, each computing a column share
  int act_ld;          // == 4 mod 32, >= every width rounded up to kTileKChunk
  int act_offset[2];   // rows x act_ld each
  int x_offset;        // rows x dim
  int stage_offset;    // the ring: slots x slot_floats, plus room to align it to kTileSwizzleBytes
  int slots;           // 2, 4 or 8
  int slot_floats;     // the widest pass x kTileStageLd
  int t_offset;
  int valid_offset;
  int coef_offset;     // kStepTablesWithPrevious x rows: this step's coefficients
  int x0_prev_offset;  // rows x dim: the previous step's x0 (a P table's term), or -1 without one
  int bias_net_offset; // the bias networks' rows (bias_net_floats of rows and cta_cols[0]), or -1
  int barrier_offset;  // 2 + kTileMaxSlots mbarriers: in a cluster, one per activation
                       // buffer; then one per slot, completed by its TMA copy
  bool vec4[kMaxLayers];  // weight rows 16-byte aligned: copy with 16-byte cp.async
  bool tma[kMaxLayers];   // chunks of layer l by TMA (TileMaps::weight[l]), else cp.async
  // Output columns of layer l per CTA of a cluster (a multiple of 8), and the
  // 8-column tiles per warp (1 to 4): narrow shares spread over every warp
  // instead of leaving most of them idle.
  int cta_cols[kMaxLayers];
  int warp_tiles[kMaxLayers];
  // In a cluster, the last layer may be split over its inner dimension
  // instead of its columns: CTA r multiplies its own share of the previous
  // layer's outputs (cta_cols[L - 2] columns from r * cta_cols[L - 2]) by
  // every column, so that layer's outputs are never exchanged; the CTAs then
  // exchange their partial sums of the dim-wide result (cluster_size x rows x
  // partial_ld floats at partial_offset, slot r from CTA r), which the update
  // adds up in rank order. cta_cols[L - 1] is then the whole (padded) layer.
  bool partial_last;
  int partial_offset;
  int partial_ld;
};

DDPM_HD inline int tile_pass_cols(const TilePlan& p, int layer) {
  return kTileWarps * 8 * p.warp_tiles[layer];
}
DDPM_HD inline int tile_passes(const TilePlan& p, int layer) {
  return (p.cta_cols[layer] + tile_pass_cols(p, layer) - 1) / tile_pass_cols(p, layer);
}

}  // namespace shapes
}  // namespace ddpm_ops
