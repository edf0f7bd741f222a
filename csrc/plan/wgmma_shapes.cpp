// The shapes of the wgmma kernels (sm_90a): bf16_wgmma, bf16x3_wgmma_m64 and
// bf16x3_wgmma_swapab.
#include "candidates.h"
#include "shapes/bf16_wgmma.h"
#include "shapes/bf16x3_wgmma_swapab.h"

namespace ddpm_ops {
namespace plan {
namespace detail {
namespace {

using shapes::kWgmmaDimPad;

// A bf16x3_wgmma_m64 step takes about the time of own + kM64StepColumns
// columns' work (the exchange and the layers' latencies take the rest). H200,
// graph-replayed gpu us per tile and step: 7.0 at own 128 (seed shape,
// clusters of 2), 5.0 at own 64 (clusters of 4); a net of hidden width 128
// ran 0.70x as long in clusters of 2 as in clusters of 1 (BENCHMARKS.md).
constexpr int kM64StepColumns = 96;

// The envelope every wgmma kernel shares: at least one hidden layer and dim
// within layer 0's padded K.
bool in_wgmma_envelope(const Problem& a, const Device& d) {
  return d.hopper() && a.num_layers >= 2 && a.dim <= kWgmmaDimPad;
}

// The (columns per CTA, cluster size) pairs the bf16x3 kernels are built for.
struct OwnCs {
  int own, cs;
};
constexpr OwnCs kBf16x3Shapes[] = {{64, 1}, {128, 1}, {64, 2}, {128, 2}, {64, 4}};

// Of the bf16x3 shapes that hold the net (fits(own, cs, rows) and clusters
// of that size launch), in clusters of only_cs and tiles of only_rows (0:
// any), the one of least cost(own, cs, rows) (the first on a tie, so the
// smaller cluster); own = 0 where none does.
template <typename Fits, typename Cost>
OwnCs least_cost_shape(const Device& d, std::initializer_list<int> row_options, int only_cs, int only_rows,
                       int* rows_out, Fits fits, Cost cost) {
  OwnCs best{0, 0};
  int64_t best_cost = 0;
  for (const OwnCs shape : kBf16x3Shapes) {
    for (int rows : row_options) {
      if (d.max_clusters[shape.cs] == 0 || !fits(shape.own, shape.cs, rows)) continue;
      if ((only_cs != 0 && shape.cs != only_cs) || (only_rows != 0 && rows != only_rows)) continue;
      const int64_t c = cost(shape.own, shape.cs, rows);
      if (best.own == 0 || c < best_cost) {
        best = shape;
        best_cost = c;
        *rows_out = rows;
      }
    }
  }
  return best;
}

// A bf16x3_wgmma_swapab step's time, in units of about 1/8 us at the seed
// shape's 16 steps, fitted to the H200's graph-replayed gpu us
// (docs/kernels.md): the bytes a CTA receives per step (rows x (cs - 1)) and
// the weights it reads per step (own) bound it. Seed shape, one wave: 42.5 us
// in clusters of 4 with 8-row tiles (model 328), 56.4 to 58.4 with 16 (448),
// 68.4 to 73.6 with 24 (568), 79.9 to 83.0 with 32 (688); 56.7 in clusters of
// 2 with 8 (440).
int64_t swapab_step_cost(int own, int cs, int rows) { return 5 * rows * (cs - 1) + 3 * own + 16; }

// A bf16x3 kernel's plan: `shape` on tiles of `rows` rows, one wave of
// clusters at most (each cluster takes tiles until the batch is done).
template <typename Layout>
void bf16x3_plan(Kernel kernel, OwnCs shape, int rows, const Layout& layout, int threads, const Problem& a,
                 const Device& d, Plan* plan) {
  plan->kernel = kernel;
  plan->own = shape.own;
  plan->hidden = layout.hidden();
  plan->cluster_size = shape.cs;
  plan->co_resident = d.max_clusters[shape.cs];
  plan->rows = rows;
  plan->tiles = ceil_div(a.batch, rows);
  plan->grid = std::min<int64_t>(d.max_clusters[shape.cs], plan->tiles);
  plan->threads = threads;
  plan->smem = shapes::wgmma_request(layout, d.max_smem);
}

}  // namespace

// bf16_wgmma's padded hidden width (64, 128, 192 or 256): it needs a hidden
// layer, dim <= 64, hidden widths <= 256 and the bf16 net within shared
// memory (bf16_wgmma.cuh).
bool bf16_wgmma_shape(const Problem& a, const Device& d, Plan* plan) {
  using shapes::kWgmmaCols;
  if (!in_wgmma_envelope(a, d)) return false;
  const int h = round_up(widest_hidden(a), kWgmmaCols);
  const shapes::Bf16WgmmaLayout layout{h, a.num_layers};
  if (h > 4 * kWgmmaCols || layout.bytes() > d.max_smem) return false;
  plan->kernel = Kernel::kBf16Wgmma;
  plan->hidden = h;
  plan->rows = shapes::kWgmmaRows;
  plan->tiles = ceil_div(a.batch, shapes::kWgmmaRows);
  plan->grid = std::min<int64_t>(d.sm_count, plan->tiles);
  plan->cluster_size = 0;
  plan->threads = shapes::kBf16Threads;
  plan->smem = shapes::wgmma_request(layout, d.max_smem);
  return true;
}

// bf16x3_wgmma_m64's shape: kOwn columns of each hidden layer per CTA in
// clusters of cs. It needs the bf16_wgmma envelope and both bf16 planes of a
// CTA's share, and the exchange buffer, within shared memory. Of the shapes
// that hold the net it takes the one with the least time, waves of tiles
// times a step's (kM64StepColumns), the smaller cluster on a tie: clusters
// of 4 while the tiles fit in one wave of them, a cluster of 1 where the
// whole net fits one CTA and the tiles fill the GPU. Two exchange buffers
// where they fit (no cluster barrier per exchange; ClusterLink), else one.
bool bf16x3_wgmma_m64_shape(const Problem& a, const Device& d, const Overrides& o, Plan* plan) {
  if (!in_wgmma_envelope(a, d)) return false;
  const int widest = widest_hidden(a);
  const int64_t tiles = ceil_div(a.batch, shapes::kWgmmaRows);
  auto fits = [&](int own, int cs, int) {
    const shapes::Bf16x3Layout layout{own, cs, a.num_layers};
    return layout.hidden() >= widest && layout.bytes() <= d.max_smem;
  };
  auto cost = [&](int own, int cs, int) { return ceil_div(tiles, d.max_clusters[cs]) * (own + kM64StepColumns); };
  int rows = 0;
  const int forced_cs = forced_cluster_size(d, o);
  OwnCs shape = forced_cs != 0 ? least_cost_shape(d, {0}, forced_cs, 0, &rows, fits, cost) : OwnCs{0, 0};
  if (shape.own == 0) shape = least_cost_shape(d, {0}, 0, 0, &rows, fits, cost);
  if (shape.own == 0) return false;
  const bool two = shape.cs > 1 && shapes::Bf16x3Layout{shape.own, shape.cs, a.num_layers, 2}.bytes() <= d.max_smem;
  const shapes::Bf16x3Layout layout{shape.own, shape.cs, a.num_layers, two ? 2 : 1};
  bf16x3_plan(Kernel::kBf16x3WgmmaM64, shape, shapes::kWgmmaRows, layout, shapes::kBf16x3Threads, a, d, plan);
  plan->buffers = layout.buffers;
  return true;
}

// bf16x3_wgmma_swapab's shape: kOwn columns of each hidden layer per CTA in
// clusters of cs, tiles of `rows` rows. It needs the bf16x3_wgmma_m64
// envelope, the CTA's share within the shared memory, and (unless forced)
// one wave of clusters that holds the batch: a second wave would double the
// time, and there bf16x3_wgmma_m64's 64-row tiles are faster (seed shape,
// batch 1024: 94.5 us against 99.4 in two waves of 8-row tiles in clusters of
// 2). Of those shapes it takes the one of least swapab_step_cost. Where
// DDPM_OPS_CUDA_CLUSTER_SIZE or DDPM_OPS_CUDA_TILE_ROWS force a shape, it may
// take any number of waves.
bool bf16x3_wgmma_swapab_shape(const Problem& a, const Device& d, const Overrides& o, Plan* plan) {
  if (!in_wgmma_envelope(a, d)) return false;
  const int widest = widest_hidden(a);
  auto waves = [&](int cs, int rows) { return ceil_div(ceil_div(a.batch, rows), d.max_clusters[cs]); };
  bool any_waves = true;
  auto fits = [&](int own, int cs, int rows) {
    const shapes::SwapabLayout layout{own, cs, a.num_layers, rows};
    return layout.hidden() >= widest && layout.bytes() + shapes::kWgmmaAlign <= d.max_smem &&
           (any_waves || waves(cs, rows) == 1);
  };
  auto cost = [&](int own, int cs, int rows) { return waves(cs, rows) * swapab_step_cost(own, cs, rows); };
  const int forced_cs = forced_cluster_size(d, o);
  int rows = 0;
  OwnCs shape{0, 0};
  if (forced_cs != 0 || o.tile_rows != 0)
    shape = least_cost_shape(d, {8, 16, 24, 32}, forced_cs, o.tile_rows, &rows, fits, cost);
  any_waves = false;
  if (shape.own == 0) shape = least_cost_shape(d, {8, 16, 24, 32}, 0, 0, &rows, fits, cost);
  if (shape.own == 0) return false;
  const shapes::SwapabLayout layout{shape.own, shape.cs, a.num_layers, rows};
  bf16x3_plan(Kernel::kBf16x3WgmmaSwapab, shape, rows, layout, shapes::kSwapabThreads, a, d, plan);
  return true;
}

}  // namespace detail
}  // namespace plan
}  // namespace ddpm_ops
