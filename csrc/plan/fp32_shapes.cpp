// The shapes of the kernels on CUDA cores and mma.sync: fp32_resident,
// fp32_smem and tf32x3_tiled, and the rule between the last two.
#include "candidates.h"
#include "shapes/bias_net.h"
#include "shapes/fp32_resident.h"

#include <algorithm>
#include <limits>
#include <string>

namespace ddpm_ops {
namespace plan {
namespace detail {
namespace {

using shapes::slice_size;

// Up to this many rows per cluster, fp32_smem computes the last layer whole
// on every CTA (no exchange) when it fits; beyond, its compute outweighs one
// barrier.
constexpr int kReplicateMaxRows = 4;
// From this batch tf32x3_tiled beats fp32_smem; from kStreamedMinBatch it
// does so for nets whose weights fp32_smem cannot keep on chip (measured on
// the H200, graph-replayed gpu us: seed batch 768, 16-row tiles in clusters
// of 2 258 against fp32_smem's 265, batch 512 259 against 161; policy batch
// 128 139 against 156, batch 64 126 against 106; BENCHMARKS.md;
// tiled_or_smem).
constexpr int64_t kTiledMinBatch = 768;
constexpr int64_t kStreamedMinBatch = 128;
// fp32_resident: from this many steps a tie between shapes goes to the fewer
// rows per cluster (fp32_resident_shape).
constexpr int kResidentManySteps = 8;

// tf32x3_tiled's plan for 16 * mt rows in clusters of cs CTAs: how the CTAs
// share each layer's work and the shared-memory layout, with the last layer
// split over its inner dimension (TilePlan::partial_last) if try_partial and
// the shape allows, chunks by TMA for the layers it can address if
// tma_chunks, and the bias networks' rows of `window` steps (none for 0).
// Returns the shared memory the plan needs.
size_t plan_tiled_layout(const Problem& a, int mt, int cs, bool try_partial, bool tma_chunks, int window,
                         shapes::TilePlan* plan) {
  using shapes::kTileKChunk;
  using shapes::kTileMaxWarpTiles;
  using shapes::kTileWarps;
  const int L = a.num_layers;
  const int rows = 16 * mt;
  int act_width = round_up(std::max(a.dim + 1, widest_hidden(a)), kTileKChunk);
  *plan = {};
  plan->cluster_size = cs;
  for (int l = 0; l < L; ++l) {
    plan->cta_cols[l] = round_up((a.layers[l].out + cs - 1) / cs, 8);
  }
  // Splitting the last layer's inner dimension saves an exchange of the
  // widest activations per step, and the last layer (dim wide) then keeps
  // every CTA busy. Each CTA's inner range is whole chunks (so layer L - 2's
  // shares are), inside the activation rows (which may have to widen).
  const bool partial = try_partial && cs > 1 && L >= 2;
  plan->partial_last = partial;
  if (partial) {
    plan->cta_cols[L - 2] = round_up((a.layers[L - 2].out + cs - 1) / cs, kTileKChunk);
    act_width = std::max(act_width, cs * plan->cta_cols[L - 2]);
  }
  const int partial_ld = round_up4(a.dim);
  const size_t partial_floats = static_cast<size_t>(cs) * rows * partial_ld;
  if (partial) plan->cta_cols[L - 1] = round_up(a.dim, 8);
  int widest_pass = 0;
  for (int l = 0; l < L; ++l) {
    const LayerShape& la = a.layers[l];
    plan->vec4[l] = la.in % 4 == 0 && la.aligned;
    // TMA needs the same: a 16-byte aligned matrix with 16-byte row strides.
    plan->tma[l] = tma_chunks && plan->vec4[l];
    // The fewest passes that cover the CTA's share, and the fewest tiles per
    // warp for them: every warp gets work in a narrow share (the last layer
    // is dim wide), and a share of 192 columns takes 3 tiles per warp rather
    // than 4 on 6 warps (a pass is as slow as its busiest warp).
    const int warp_cols = kTileWarps * 8;
    const int passes = (plan->cta_cols[l] + warp_cols * kTileMaxWarpTiles - 1) / (warp_cols * kTileMaxWarpTiles);
    plan->warp_tiles[l] = (plan->cta_cols[l] + passes * warp_cols - 1) / (passes * warp_cols);
    widest_pass = std::max(widest_pass, shapes::tile_pass_cols(*plan, l));
  }
  // Narrow passes leave room for more chunks in flight.
  plan->slot_floats = widest_pass * shapes::kTileStageLd;
  plan->slots = shapes::kTileMaxSlots;  // a power of two (the ring's index wraps by a mask)
  while (plan->slots * plan->slot_floats > shapes::kTileStageFloats) plan->slots /= 2;
  const int ld = act_width + 4;
  plan->act_ld = ld;
  plan->act_offset[0] = 0;
  plan->act_offset[1] = rows * ld;
  plan->x_offset = 2 * rows * ld;
  // 16-byte aligned for cp.async 16
  plan->stage_offset = round_up(plan->x_offset + rows * a.dim, 4);
  plan->t_offset = plan->stage_offset + shapes::kTileStageFloats +
                   static_cast<int>(shapes::kTileSwizzleBytes / sizeof(float));
  plan->valid_offset = plan->t_offset + rows;
  plan->coef_offset = plan->valid_offset + rows;
  const int coef_end = plan->coef_offset + kStepTablesWithPrevious * rows;
  plan->x0_prev_offset = a.previous_x0 ? coef_end : -1;
  plan->barrier_offset = round_up(coef_end + (a.previous_x0 ? rows * a.dim : 0), 4);
  int end = plan->barrier_offset + 2 * (2 + shapes::kTileMaxSlots);  // 8-byte mbarriers
  if (partial) {
    plan->partial_offset = end;  // 16-byte aligned for the stores
    plan->partial_ld = partial_ld;
    end += static_cast<int>(partial_floats);
  }
  const int nets = window == 0 ? 0
                               : shapes::bias_net_floats(rows, plan->cta_cols[0], window, a.time_net,
                                                         a.cond_net, a.bias_net_hidden);
  plan->bias_net_offset = nets > 0 ? end : -1;
  return static_cast<size_t>(end + nets) * sizeof(float);
}

// plan_tiled_layout, with the partial last layer only where it fits in
// max_smem.
size_t plan_tiled(const Problem& a, int mt, int cs, const Device& d, const Overrides& o, int window,
                  shapes::TilePlan* plan) {
  // TMA is 5-12% faster than cp.async at every tile height (H200,
  // BENCHMARKS.md): fewer instructions per chunk, none on the compute warps.
  // Below 9.0 there is none, whatever the driver's encoder.
  const bool tma = d.hopper() && d.tma_encoder && o.tma;
  const size_t smem = plan_tiled_layout(a, mt, cs, true, tma, window, plan);
  return smem <= static_cast<size_t>(d.max_smem) || !plan->partial_last
             ? smem
             : plan_tiled_layout(a, mt, cs, false, tma, window, plan);
}

// Shared memory (floats) for layer l's weight slice on one CTA of a cluster of
// cs: padded rows and the bias slice.
size_t slice_floats(const Problem& a, int l, int cs) {
  const int s = slice_size(a.layers[l].out, cs);
  return static_cast<size_t>(s) * round_up4(a.layers[l].in) + round_up4(s);
}

size_t all_slices_floats(const Problem& a, int cs) {
  size_t floats = 0;
  for (int l = 0; l < a.num_layers; ++l) floats += slice_floats(a, l, cs);
  return floats;
}

// Shared memory (floats) per row of fp32_smem: layer-0 input, two hidden
// buffers, two eps buffers, x, (c1, c2), t and valid; each region is rounded
// up to 4 floats, and the mbarriers take 8 more, hence the + 28.
size_t row_floats(const Problem& a) {
  return static_cast<size_t>(round_up4(a.dim + 1)) + 2 * round_up4(widest_hidden(a)) + 2 * round_up4(a.dim) +
         a.dim + 4 + 28;
}

// Whether fp32_smem keeps every weight on chip: the slices of a 2-CTA
// cluster fit next to one row.
bool smem_weights_on_chip(const Problem& a, const Device& d) {
  return all_slices_floats(a, 2) + row_floats(a) <= d.max_smem / sizeof(float);
}

// fp32_smem's cluster size. The rule was read off every size forced on the
// H200 (bench.py --variants, diag sweeps, BENCHMARKS.md). A row per cluster
// is the fastest while the clusters are all resident at once, and the larger
// the cluster the shorter each layer. For a net whose weights fit on two CTAs
// (seed shape): the largest of 8, 4 that gives every row its own cluster
// (H200: batch 15 and 33; seed batch 16: 63 us in clusters of 4 against 86
// in clusters of 2), else 2 up to batch 512 (most clusters side by side;
// batch 512: 161 us against 202 in clusters of 4), then 4. For bigger nets
// (policy shape: 4 MB of weights, read from L2 by every cluster): 16 while
// every row gets its own cluster of 16 (most on-chip weights; H200: batch 7;
// batch 2: 41 us against 53 in clusters of 8), else 8 up to batch 32 (batch
// 32: 68 us against 76 in clusters of 16), 16 up to 64 (half the clusters,
// so half the L2 traffic: batch 64, 106 us against 116), 8 up to 256, then
// 4. DDPM_OPS_CUDA_CLUSTER_SIZE forces a size that launches (a power of
// two: the kernel's exchange indexes CTAs by bit masks). Falls back to the
// largest size below the choice that launches.
int smem_cluster_size(const Problem& a, const Device& d, const Overrides& o) {
  const int forced = forced_cluster_size(d, o);
  if (forced > 0 && (forced & (forced - 1)) == 0) return forced;
  auto row_per_cluster = [&](int size) { return a.batch <= d.max_clusters[size]; };
  int want;
  if (smem_weights_on_chip(a, d)) {
    want = row_per_cluster(8) ? 8 : (row_per_cluster(4) ? 4 : (a.batch <= 512 ? 2 : 4));
  } else if (row_per_cluster(16)) {
    want = 16;
  } else {
    want = a.batch <= 32 ? 8 : (a.batch <= 64 ? 16 : (a.batch <= 256 ? 8 : 4));
  }
  int chosen = 1;
  for (int size = 1; size <= want; size *= 2) {
    if (d.max_clusters[size] > 0) chosen = size;
  }
  return chosen;
}

// The work split of one layer with `cols` output columns per CTA over `rows`
// rows, for the kernel instantiation whose warp tiles have vr rows: the
// narrowest column tile (2 to 16 columns, at most 32 outputs) that gives
// every warp at most one tile, or the widest: a warp's tiles run one after
// the other, each a dependent chain of loads, products and shuffles, so one
// tile per warp is the shortest layer.
shapes::LayerWork make_work(int cols, int rows, int vr) {
  shapes::LayerWork w = {};
  w.cols = cols;
  const int row_tiles = (rows + vr - 1) / vr;
  const int widest_log2 = shapes::smem_widest_vc_log2(vr);
  int vc_log2 = 1;
  auto tiles_c = [&](int log2) { return std::max(1, (cols + (1 << log2) - 1) >> log2); };
  while (vc_log2 < widest_log2 && row_tiles * tiles_c(vc_log2) > shapes::kSmemWarps) ++vc_log2;
  w.vc_log2 = vc_log2;
  w.tiles_c = tiles_c(vc_log2);
  w.tiles_c_magic = shapes::magic_divisor(w.tiles_c);
  w.ntiles = row_tiles * w.tiles_c;
  return w;
}

// The rows per cluster: the batch spread over all co-resident clusters. If
// that leaves too little room for the weights but 8 rows would not, the tile
// shrinks (down to 8 rows) so the weights stay on chip; then while even the
// activations do not fit.
int smem_rows(const Problem& a, int max_clusters, size_t weight_floats, size_t per_row, size_t budget) {
  const int64_t per_cluster = ceil_div(a.batch, max_clusters);
  int rows = static_cast<int>(std::min<int64_t>(per_cluster, shapes::kSmemMaxRows));
  if (8 * per_row + weight_floats <= budget) {
    while (rows > 8 && rows * per_row + weight_floats > budget) rows /= 2;
  }
  while (rows > 1 && rows * per_row > budget) rows /= 2;
  return rows;
}

Plan fp32_smem_plan(const Problem& a, const Device& d, const Overrides& o) {
  Plan plan;
  plan.kernel = Kernel::kFp32Smem;
  const int cs = smem_cluster_size(a, d, o);
  const int L = a.num_layers;
  shapes::SmemPlan& p = plan.smem_plan;
  p.cluster_size = cs;
  p.in0_ld = round_up4(a.dim + 1);
  p.hidden_ld = round_up4(widest_hidden(a));
  p.eps_ld = round_up4(a.dim);
  const size_t weight_floats = all_slices_floats(a, cs);
  const size_t per_row = row_floats(a);
  const size_t budget = d.max_smem / sizeof(float);
  const std::string too_wide = "ddpm::fused_sample: dim " + std::to_string(a.dim) +
                               " and the hidden widths need more shared memory per sample than the GPU has (" +
                               std::to_string(d.max_smem) + " bytes per block)";
  const int rows = smem_rows(a, d.max_clusters[cs], weight_floats, per_row, budget);
  if (rows * per_row > budget) {
    plan.error = too_wide;
    return plan;
  }
  p.rows_per_tile = rows;
  // Rows of a warp's output tile: every weight load serves them all.
  const int vr = rows <= 2 ? rows : 4;
  int offset = 0;
  auto take = [&](int floats) {  // 16-byte aligned regions
    const int at = offset;
    offset += round_up4(floats);
    return at;
  };
  // in0 and the hidden buffers are contiguous: the kernel zeroes them at once.
  p.in0_offset = take(rows * p.in0_ld);
  p.hidden_offset[0] = take(rows * p.hidden_ld);
  p.hidden_offset[1] = take(rows * p.hidden_ld);
  p.eps_offset[0] = take(rows * p.eps_ld);
  p.eps_offset[1] = take(rows * p.eps_ld);
  p.x_offset = take(rows * a.dim);
  p.coef_offset = take(2 * rows);
  p.t_offset = take(rows);
  p.valid_offset = take(rows);
  p.barrier_offset = take(2 * shapes::kExchangeBuffers);
  if (static_cast<size_t>(offset) > budget) {
    plan.error = too_wide;
    return plan;
  }
  // With few rows per cluster the step is latency-bound: if everything fits,
  // every CTA holds the whole last layer and computes it for itself, which
  // saves one cluster barrier per step.
  const int last_in_ld = round_up4(a.layers[L - 1].in);
  const size_t last_floats = static_cast<size_t>(a.dim) * last_in_ld + round_up4(a.dim);
  const bool replicate = rows <= kReplicateMaxRows &&
                         offset + weight_floats - slice_floats(a, L - 1, cs) + last_floats <= budget;
  p.last_weight_offset = -1;
  p.last_bias_offset = -1;
  if (replicate) {
    p.last_weight_offset = take(a.dim * last_in_ld);
    p.last_bias_offset = take(a.dim);
    p.last_work = make_work(a.dim, rows, vr);
  }
  // Weight slices that fit stay in shared memory; the rest are read from
  // global memory (L2).
  for (int l = 0; l < L; ++l) {
    p.weight_offset[l] = -1;
    p.bias_offset[l] = -1;
    if (replicate && l == L - 1) continue;
    const int s = slice_size(a.layers[l].out, cs);
    if (offset + slice_floats(a, l, cs) <= budget) {
      p.weight_offset[l] = take(s * round_up4(a.layers[l].in));
      p.bias_offset[l] = take(s);
    }
    p.work[l] = make_work(s, rows, vr);
  }
  plan.threads = shapes::kSmemThreads;
  plan.cluster_size = cs;
  plan.co_resident = d.max_clusters[cs];
  plan.rows = rows;
  plan.tiles = ceil_div(a.batch, rows);
  plan.grid = plan.tiles;
  plan.smem = offset * static_cast<int>(sizeof(float));
  plan.warp_rows = vr;
  return plan;
}

// The bias networks' rows in the largest window that fits beside the tile.
Plan tiled_plan(const Problem& a, const Device& d, const Overrides& o, int mt, int cs) {
  Plan plan;
  plan.kernel = Kernel::kTf32x3Tiled;
  plan.bias_window = bias_window(a, [&](int w) {
    shapes::TilePlan tile;
    return plan_tiled(a, mt, cs, d, o, w, &tile) <= static_cast<size_t>(d.max_smem);
  });
  plan.smem = static_cast<int>(plan_tiled(a, mt, cs, d, o, plan.bias_window, &plan.tile_plan));
  plan.threads = shapes::kTileThreads;
  // Where clusters do not launch (below 9.0), a tile is one CTA of a plain launch.
  plan.cluster_size = d.hopper() && d.max_clusters[1] > 0 ? cs : 0;
  plan.co_resident = d.max_clusters[cs];
  plan.rows = 16 * mt;
  plan.tiles = ceil_div(a.batch, 16 * mt);
  plan.grid = plan.tiles;
  plan.products = a.precision == Precision::kFloat32 ? 3 : 1;
  return plan;
}

// tf32x3_tiled's tile height (16 * mt rows) and cluster size by the rule
// below, or mt = 0 where the rule leaves the call to fp32_smem.
struct TiledShape {
  int mt = 0, cs = 1;
};

// The rule, read off every variant forced on the H200 (bench.py --variants,
// BENCHMARKS.md):
//   - from batch kTiledMinBatch, 64-row tiles, one CTA each, once they fill
//     7/8 of the multiprocessors (fewest weight reads per row; seed shape,
//     batch 8192, 128 tiles on 132: 793 us against 893 in 16-row tiles);
//   - otherwise, from batch kTiledMinBatch, or from batch kStreamedMinBatch
//     for a net whose weights fp32_smem cannot keep on chip (it would read
//     them from L2 at CUDA-core speed): 16-row tiles,
//     each layer's columns split over the largest cluster (up to 16, any
//     size) of which every tile's cluster is resident at once: a CTA's share
//     of the weight stream, the bound at these sizes, shrinks with the
//     cluster, and a second wave would double the time. (Seed shape, 16-row
//     tiles against 32- and 64-row tiles: batch 1024 271 us in clusters of 2
//     against 480 and 783, batch 6144 752 against 947 and 788.)
//   - otherwise fp32_smem.
// Where fp32_smem does not run the call (the general step, a GPU below 9.0)
// fp32_rule takes its place below kTiledMinBatch (Diffusion-QL's net, batch
// 256, graph-replayed through DiffusionSampler: 101 us on fp32_rule, 174 in
// 16-row tiles; seed net, batch 4096: 624 in tiles, 1104 on fp32_rule), and
// `any_batch` asks for tiles where fp32_rule does not fit.
// DDPM_OPS_CUDA_CLUSTER_SIZE sets the cluster size (1 to 16).
TiledShape tiled_shape_by_rule(const Problem& a, const Device& d, const Overrides& o, bool smem_runs_it,
                               bool any_batch) {
  auto fits = [&](int mt) {
    shapes::TilePlan plan;
    return plan_tiled(a, mt, 1, d, o, 0, &plan) <= static_cast<size_t>(d.max_smem);
  };
  auto tiles = [&](int mt) { return ceil_div(a.batch, 16 * mt); };
  TiledShape shape;
  if (a.batch >= kTiledMinBatch && fits(4) && 8 * tiles(4) >= 7 * d.sm_count) shape.mt = 4;
  const bool streamed = a.batch >= kStreamedMinBatch && !smem_weights_on_chip(a, d);
  const bool streamed_here = smem_runs_it ? streamed : any_batch;
  if (shape.mt == 0 && (streamed_here || a.batch >= kTiledMinBatch) && fits(1)) {
    shape.mt = 1;
    for (int size = kMaxClusterSize; size > 1; --size) {
      if (tiles(1) <= d.max_clusters[size]) {
        shape.cs = size;
        break;
      }
    }
  }
  if (const int forced_cs = forced_cluster_size(d, o)) shape.cs = forced_cs;
  return shape;
}

// DDPM_OPS_CUDA_KERNEL=tiled16|32|64: that tile height, where it fits.
int forced_tile_height(const Problem& a, const Device& d, const Overrides& o) {
  if (!(o.names_kernel && o.kernel == Kernel::kTf32x3Tiled)) return 0;
  shapes::TilePlan plan;
  const int mt = o.tiled_rows / 16;
  return plan_tiled(a, mt, 1, d, o, 0, &plan) <= static_cast<size_t>(d.max_smem) ? mt : 0;
}

}  // namespace

// DDPM_OPS_CUDA_KERNEL=cluster forces fp32_smem, tiled16|32|64 a tile height
// (fp32_smem where that tile does not fit), any other value leaves the rule
// (tiled_shape_by_rule) as it is.
Plan tiled_or_smem(const Problem& a, const Device& d, const Overrides& o) {
  if (o.names_kernel && (o.kernel == Kernel::kFp32Smem || o.kernel == Kernel::kTf32x3Tiled)) {
    const int mt = forced_tile_height(a, d, o);
    if (mt > 0) return tiled_plan(a, d, o, mt, std::max(forced_cluster_size(d, o), 1));
    return fp32_smem_plan(a, d, o);
  }
  const TiledShape shape = tiled_shape_by_rule(a, d, o, /*smem_runs_it=*/true, /*any_batch=*/false);
  if (shape.mt == 0) return fp32_smem_plan(a, d, o);
  return tiled_plan(a, d, o, shape.mt, shape.cs);
}

bool tf32x3_tiled_shape(const Problem& a, const Device& d, const Overrides& o, bool any_batch, Plan* plan) {
  if (d.sm_count <= 0 || d.max_smem <= 0) return false;
  int mt = forced_tile_height(a, d, o), cs = std::max(forced_cluster_size(d, o), 1);
  if (mt == 0) {
    const TiledShape shape = tiled_shape_by_rule(a, d, o, /*smem_runs_it=*/false, any_batch);
    mt = shape.mt;
    cs = shape.cs;
  }
  if (mt == 0) return false;
  *plan = tiled_plan(a, d, o, mt, cs);
  return true;
}

// fp32_resident's shape (fp32_resident.cuh): kOpw outputs of every hidden
// layer per warp, so clusters of H / (8 kOpw) CTAs, and `rows` rows per
// cluster. It needs 2 to 4 layers, dim <= 64 and every hidden layer H <= 256
// wide, a multiple of 8 kOpw; the weights of every layer but the first
// 16-byte aligned (as torch allocates them); and every cluster resident at
// once (a second wave would double the time) with at most 8 rows each (kOpw
// = 2, 4 or 16 and the rows within the registers: resident_fits, its
// buffers within shared memory: resident_bias_floats_at). Of the
// shapes that do, the one with the fewest products per lane (rows x kOpw),
// clusters of 16 only where no other shape runs the call; on a tie, for
// calls of at least kResidentManySteps steps the fewer rows per cluster
// (each step is cheaper), for shorter ones the fewer outputs per warp (fewer
// weights to load per CTA: about 6 us at 16 outputs per warp). H200,
// graph-replayed gpu us (docs/kernels.md), seed shape (16 steps): batch 1
// 20.6 in clusters of 8 (1 x 4), 25.1 in clusters of 16 (1 x 2); batch 16
// 25.2 in clusters of 8 (2 x 4), 31.6 in clusters of 2 (1 x 16); batch 60
// 36.2 in clusters of 8 (4 x 4), 32.2 in clusters of 2 (1 x 16; 25.9 since
// the last layer's reads lost their bank conflicts); batch 64 26.0 in
// clusters of 2, 56.9 in clusters of 8 (8 x 4). Dim 12 (5 steps), batch 60:
// 12.0 in clusters of 8 (4 x 4), 13.4 in clusters of 2 (1 x 16; since then
// 11.8 and 11.3: the short-call tie may now go the other way, BENCHMARKS.md's
// leads). Hidden width 128, 4 layers, 10 steps, batch 16 (at a53176e, before
// the float4 weight loads): 17.3 in clusters of 4 (1 x 4), 20.1 in clusters
// of 8 (2 x 2).
bool fp32_resident_shape(const Problem& a, const Device& d, const Overrides& o, Plan* plan) {
  using shapes::kResidentWarps;
  struct Shape {
    int opw = 0, rows = 0, cs = 0;
  };
  const int L = a.num_layers;
  if (!d.hopper() || L < 2 || L > shapes::kResidentMaxLayers || a.dim > shapes::kResidentMaxDim)
    return false;
  const int H = a.layers[0].out;
  for (int l = 1; l + 1 < L; ++l) {
    if (a.layers[l].out != H) return false;
  }
  if (H > shapes::kResidentMaxHidden) return false;
  for (int l = 1; l < L; ++l) {
    if (!a.layers[l].aligned) return false;
  }
  auto shape_of = [&](int opw) {
    const int cs = H / (kResidentWarps * opw);
    if (H % (kResidentWarps * opw) != 0 || cs > kMaxClusterSize || d.max_clusters[cs] == 0) return Shape{};
    for (int rows : {1, 2, 4, 8}) {
      const size_t buffers = sizeof(float) * shapes::resident_bias_floats_at(opw, rows);
      if (shapes::resident_fits(opw, rows, L) && buffers <= static_cast<size_t>(d.max_smem) &&
          ceil_div(a.batch, rows) <= d.max_clusters[cs])
        return Shape{opw, rows, cs};
    }
    return Shape{};
  };
  auto better = [&](const Shape& p, const Shape& q) {  // p before q
    if (q.opw == 0 || p.opw == 0) return p.opw != 0;
    if ((p.cs > 8) != (q.cs > 8)) return p.cs <= 8;
    if (p.rows * p.opw != q.rows * q.opw) return p.rows * p.opw < q.rows * q.opw;
    return a.num_steps >= kResidentManySteps ? p.rows < q.rows : p.opw < q.opw;
  };
  const int forced_cs = forced_cluster_size(d, o);
  Shape best;
  for (int opw : {2, 4, 16}) {
    const Shape shape = shape_of(opw);
    if (forced_cs != 0 && shape.cs == forced_cs) {
      best = shape;
      break;
    }
    if (better(shape, best)) best = shape;
  }
  if (best.opw == 0) return false;
  plan->kernel = Kernel::kFp32Resident;
  plan->opw = best.opw;
  plan->rows = best.rows;
  plan->cluster_size = best.cs;
  plan->co_resident = d.max_clusters[best.cs];
  plan->tiles = ceil_div(a.batch, best.rows);
  plan->grid = plan->tiles;
  plan->threads = shapes::kResidentThreads;
  // All of the shared memory: one CTA per multiprocessor (fp32_resident.cuh).
  plan->smem = d.max_smem;
  const int at = shapes::resident_bias_floats_at(best.opw, best.rows);
  plan->bias_window = bias_window(a, [&](int w) {
    return sizeof(float) * (at + shapes::bias_net_floats(best.rows, 8 * best.opw, w, a.time_net, a.cond_net,
                                                         a.bias_net_hidden)) <=
           static_cast<size_t>(d.max_smem);
  });
  return true;
}

namespace {

// fp32_rule's cost of one step of one wave, in ns: the weights each CTA
// streams from L2 (its share of every layer not kept on chip), its products
// and, in a cluster, a barrier per Linear and per step. Fitted (least
// squares of the relative error, median 17%) to benchmarks/sweep_rule.py on
// an H200: IDQL's LN-ResNet and MLP, DPPO's residual MLP and the
// Diffusion-QL chain at batch 1 to 1024 in clusters of 1 to 16. A cluster
// holds at most kRuleClusterMaxRows rows: 8 and 16 lost to fewer rows in
// every shape measured (IDQL batch 64: 558 us in clusters of 16 with 16
// rows, 286 in clusters of 4 with 4), more than the model says.
constexpr double kRuleL2NsPerKiloFloat = 30.7;
constexpr double kRuleFmaNsPerKiloFloatRow = 15.9;
constexpr double kRuleClusterBarrierNs = 2760.0;
constexpr int kRuleClusterMaxRows = 4;

// Keeps the largest shares of the layers' weights that fit `free_floats` of
// shared memory from float `base` on (RuleWeights); returns the kilo-floats
// a CTA still streams from L2 per step, and the total in *all.
double keep_weights_on_chip(const Problem& p, int rows, int cluster, int base, int64_t free_floats,
                            shapes::RuleWeights* kept, double* all) {
  *kept = {};
  int order[kMaxLayers];
  for (int l = 0; l < p.num_layers; ++l) order[l] = l;
  const auto share = [&](int l) {
    return shapes::rule_weight_share_floats(p.layers[l].out, p.layers[l].in, cluster, rows);
  };
  std::sort(order, order + p.num_layers, [&](int a, int b) { return share(a) > share(b); });
  double streamed = 0.0;
  *all = 0.0;
  for (int i = 0; i < p.num_layers; ++i) {
    const int l = order[i];
    const double kilo = 1e-3 * share(l);
    *all += kilo;
    if (share(l) <= free_floats) {
      kept->offset[l] = base;  // within the shared memory: an int
      base += static_cast<int>(share(l));
      free_floats -= share(l);
    } else {
      streamed += kilo;
    }
  }
  return streamed;
}

}  // namespace

bool fp32_rule_shape(const Problem& p, const Device& d, const Overrides& o, Plan* plan) {
  if (d.sm_count <= 0 || d.max_smem <= 0) return false;
  const int dim_ld = round_up4(p.dim), width = round_up4(std::max({p.dim, widest_hidden(p), p.program_input}));
  const int h0 = p.layers[0].out;
  // The shared memory of a block of `rows` rows with the bias networks' rows
  // of `window` steps, and the largest window that fits (bias_window).
  const auto bytes = [&](int rows, int window) {
    return shapes::rule_smem_bytes(
        rows, dim_ld, width,
        window == 0 ? 0 : shapes::bias_net_floats(rows, h0, window, p.time_net, p.cond_net, p.bias_net_hidden),
        p.program_saved);
  };
  const auto window_of = [&](int rows) {
    return bias_window(p, [&](int w) { return bytes(rows, w) <= static_cast<size_t>(d.max_smem); });
  };
  const auto fits = [&](int rows) { return bytes(rows, window_of(rows)) <= static_cast<size_t>(d.max_smem); };
  // Where the weights kept on chip start (floats, 16-byte aligned).
  const auto kept_base = [&](int rows) {
    return round_up4(static_cast<int>(bytes(rows, window_of(rows)) / sizeof(float)));
  };
  // A shape's modelled time per step (the constants above), with the weights
  // its shared memory has room for kept on chip.
  struct Shape {
    int rows = 0, cluster = 1;
    shapes::RuleWeights kept = {};
    double ns = std::numeric_limits<double>::infinity();
  };
  const auto shape = [&](int rows, int cluster, int64_t co_resident) {
    Shape s;
    s.rows = rows;
    s.cluster = cluster;
    const int base = kept_base(rows);
    double all = 0.0;
    const double streamed = keep_weights_on_chip(p, rows, cluster, base, d.max_smem / 4 - base, &s.kept, &all);
    const int64_t waves = ceil_div(ceil_div(p.batch, rows), co_resident);
    const double products = all * rows * kRuleFmaNsPerKiloFloatRow + streamed * kRuleL2NsPerKiloFloat;
    const double barriers = cluster > 1 ? (p.num_layers + 1) * kRuleClusterBarrierNs : 0.0;
    s.ns = static_cast<double>(waves) * (products + barriers);
    return s;
  };
  // Alone: rows per block doubled from 1 while the blocks would outnumber the
  // SMs' share of the batch (a small batch spreads over the SMs, a large one
  // reuses each weight it loads for more rows), then halved until the block
  // fits.
  int rows = 1;
  while (rows < shapes::kRuleMaxRows && static_cast<int64_t>(rows) * d.sm_count < p.batch) rows *= 2;
  while (rows >= 1 && !fits(rows)) rows /= 2;
  if (rows < 1) return false;
  // On Hopper a cluster may run each row group instead, its CTAs splitting
  // every Linear's columns (fp32_rule.cuh): the shape of least modelled time
  // over every size that launches and every rows that fit, or the best of
  // the size DDPM_OPS_CUDA_CLUSTER_SIZE names.
  const int forced = d.hopper() ? forced_cluster_size(d, o) : 0;
  Shape best = forced > 1 ? Shape{} : shape(rows, 1, d.sm_count);
  for (int size = 2; d.hopper() && size <= kMaxClusterSize; ++size) {
    if (d.max_clusters[size] <= 0 || (forced > 0 && size != forced)) continue;
    for (int r = 1; r <= kRuleClusterMaxRows && fits(r); r *= 2) {
      const Shape s = shape(r, size, d.max_clusters[size]);
      if (s.ns < best.ns) best = s;
    }
  }
  plan->kernel = Kernel::kFp32Rule;
  plan->rows = best.rows;
  plan->threads = shapes::rule_threads(best.rows);
  plan->cluster_size = best.cluster > 1 ? best.cluster : 0;
  plan->co_resident = best.cluster > 1 ? d.max_clusters[best.cluster] : 0;
  plan->grid = plan->tiles = ceil_div(p.batch, best.rows);
  plan->bias_window = window_of(best.rows);
  plan->rule_weights = best.kept;
  int64_t kept_floats = 0;
  for (int l = 0; l < p.num_layers; ++l) {
    if (best.kept.offset[l] != 0) {
      kept_floats += shapes::rule_weight_share_floats(p.layers[l].out, p.layers[l].in, best.cluster, best.rows);
    }
  }
  plan->smem = static_cast<int>(kept_floats > 0 ? sizeof(float) * (kept_base(best.rows) + kept_floats)
                                               : bytes(best.rows, plan->bias_window));
  return true;
}

}  // namespace detail
}  // namespace plan
}  // namespace ddpm_ops
