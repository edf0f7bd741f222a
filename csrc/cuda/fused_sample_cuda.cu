// CUDA kernel of ddpm::fused_sample: argument handling, the choice between
// the kernels of fused_sample_kernels.cuh, wgmma_kernel.cuh, split_kernel.cuh,
// narrow_kernel.cuh and resident_kernel.cuh, and their launch.
//
// Which kernel (a simple rule, from measurements on an H200; BENCHMARKS.md;
// details at use_wgmma, use_resident, use_narrow, use_split, choose_tiled
// and cluster_size_log2), the first that applies:
//   - for precision "bf16", from batch kWgmmaMinBatch, the wgmma kernel of
//     wgmma_kernel.cuh (bf16 operands, fp32 accumulation, the whole net in
//     shared memory) where the GPU is sm_90 and the net within its envelope
//     (wgmma_hidden);
//   - at small batches (up to 8 rows per cluster, every cluster resident at
//     once: seed shape, batch 120 on the H200), in any precision, the
//     resident kernel (exact fp32, every weight in registers) where the net
//     is within its envelope (resident_shape);
//   - from batch kNarrowMinBatch, in any precision, the narrow kernel of
//     narrow_kernel.cuh (the split kernel's exact products on 8- to 32-row
//     tiles) where the GPU is sm_90, the net within its envelope and one
//     wave of its clusters holds the batch (narrow_shape: seed shape, up to
//     960 rows on the H200);
//   - from batch kSplitMinBatch, in any precision, the split kernel of
//     split_kernel.cuh (exact fp32 from bf16x3 products on wgmma, the net
//     split over a cluster of 1, 2 or 4) where the GPU is sm_90 and the net
//     within its envelope (split_shape);
//   - the tiled tensor-core kernel (3xTF32 for "fp32", one tf32 product for
//     "tf32" and "bf16") from batch 768, and from batch 128 for nets whose
//     weights the cluster kernel cannot keep on chip, when its row tile fits
//     in shared memory;
//   - otherwise the cluster kernel (exact fp32 on CUDA cores).
// DDPM_OPS_CUDA_KERNEL=cluster|tiled16|tiled32|tiled64|wgmma|split|narrow|
// resident forces one (wgmma only for "bf16"; wgmma, split, narrow and
// resident where the net and batch fit them, else the rule decides) and
// DDPM_OPS_CUDA_CLUSTER_SIZE the cluster size (tests, benchmarks: 1 to 16
// for the tiled kernel, a power of two for the cluster kernel, 1, 2 or 4
// for the split and narrow kernels, H / 16, H / 32 or H / 128 for the
// resident kernel); DDPM_OPS_CUDA_TILE_ROWS=8|16|24|32 the narrow kernel's
// tile rows;
// DDPM_OPS_CUDA_TMA=0 makes the tiled kernel copy its weight chunks with
// cp.async only (tests, benchmarks; details at use_tma);
// DDPM_OPS_CUDA_LOG=1 prints each launch's plan to stderr (diagnostics).
#include "../fused_sample.h"
#include "fused_sample_kernels.cuh"
#include "resident_kernel.cuh"
#include "narrow_kernel.cuh"  // and split_kernel.cuh, wgmma_kernel.cuh

#include <ATen/ATen.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <cudaTypedefs.h>  // PFN_cuTensorMapEncodeTiled
#include <torch/library.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <set>
#include <string>
#include <utility>
#include <vector>

namespace ddpm_ops {
namespace {

using cuda_kernels::ClusterPlan;
using cuda_kernels::kMaxClusterRows;
using cuda_kernels::kMaxLayers;
using cuda_kernels::SampleArgs;
using cuda_kernels::TileMaps;
using cuda_kernels::TilePlan;

// Up to this many rows per cluster, the last layer is computed whole on every
// CTA (no exchange) when it fits; beyond, its compute outweighs one barrier.
constexpr int kReplicateMaxRows = 4;
// From this batch the tiled kernel beats the cluster kernel; from
// kStreamedMinBatch it does so for nets whose weights the cluster kernel
// cannot keep on chip (measured on the H200, graph-replayed gpu us: seed
// batch 768, 16-row tiles in clusters of 2 258 against the cluster kernel's
// 265, batch 512 259 against 161; policy batch 128 139 against 156, batch 64
// 126 against 106; BENCHMARKS.md; choose_tiled).
constexpr int64_t kTiledMinBatch = 768;
constexpr int64_t kStreamedMinBatch = 128;

// From this batch "bf16" takes the wgmma kernel (where it can): below it the
// cluster kernel's exact fp32 is faster. H200, seed shape, graph-replayed gpu
// us: the wgmma kernel takes about 117 at any batch up to 64 x 132 rows; the
// cluster kernel 101 at batch 256, where its 66 co-resident clusters of 2
// carry 4 rows each and every CTA computes the whole last layer, but 160 at
// 288, with 5 rows each and the last layer exchanged (BENCHMARKS.md).
constexpr int64_t kWgmmaMinBatch = 265;

// From this batch every precision takes the split kernel (exact fp32 on
// wgmma) where it can hold the net; below it the cluster kernel is mostly
// faster. H200, graph-replayed gpu us: the split kernel takes
// about 93 at the seed shape at any batch up to 64 x 30 rows (one tile per
// cluster of 4), the cluster kernel 75 at batch 128, 101 to 105 from 160 to
// 264, 161 from 320 (from batch 265 its clusters carry 5 rows; see
// kWgmmaMinBatch); at dim 12, hidden 256, 5 steps the cluster kernel takes
// 26 at batch 128 and 36.4 at 256, the split kernel 36.7 at both. So the
// seed shape's batches 160 to 264 would run about 10% faster on the split
// kernel, smaller nets' slower (BENCHMARKS.md).
constexpr int64_t kSplitMinBatch = 265;

// From this batch the narrow kernel runs (where one wave of it holds the
// batch); below it the resident kernel's range (seed shape: up to 120 rows on
// the H200) and the cluster kernel's, which the narrow kernel beats from
// here: H200, graph-replayed gpu us, seed shape, batch 128: 42.5 against the
// cluster kernel's 74.4; dim 12, 5 steps: 20.5 against 25.3
// (docs/kernels.md).
constexpr int64_t kNarrowMinBatch = 121;

// A split-kernel step takes about the time of own + kSplitStepColumns
// columns' work (the exchange and the layers' latencies take the rest). H200,
// graph-replayed gpu us per tile and step: 7.0 at own 128 (seed shape,
// clusters of 2), 5.0 at own 64 (clusters of 4); a net of hidden width 128
// ran 0.70x as long in clusters of 2 as in clusters of 1 (BENCHMARKS.md).
constexpr int kSplitStepColumns = 96;

constexpr int kMaxClusterSize = 16;  // non-portable beyond 8

struct DeviceInfo {
  int sm_count = 0;
  int max_smem = 0;          // opt-in dynamic shared memory per block
  // Co-resident clusters of each size (one CTA per SM), 0 where that size
  // does not launch. Clusters must fit in one GPC, so this is not simply
  // sm_count / size (H200: 15 clusters of 8, 7 of 16).
  int max_clusters[kMaxClusterSize + 1] = {};
  bool wgmma = false;  // the wgmma kernel runs here: built for sm_90a, and the GPU is sm_90
};

// Raises a kernel's dynamic shared-memory limit (and, for cluster kernels,
// allows the non-portable size 16) once per device.
template <typename Kernel>
void prepare_kernel(Kernel kernel, int device, int max_smem, bool cluster) {
  static std::mutex mutex;
  static std::set<std::pair<const void*, int>> done;
  std::lock_guard<std::mutex> lock(mutex);
  const std::pair<const void*, int> key{reinterpret_cast<const void*>(kernel), device};
  if (done.count(key) != 0) return;
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, max_smem));
  if (cluster) {
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
  }
  done.insert(key);  // only once both attributes are set: a failure is retried, not remembered
}

// The configuration of a launch of `clusters` clusters of `cs` CTAs (one
// place for the attribute plumbing; not copyable: it points into itself).
struct ClusterLaunch {
  cudaLaunchConfig_t config = {};
  cudaLaunchAttribute attribute = {};
  ClusterLaunch(int64_t clusters, int cs, unsigned threads, size_t smem, cudaStream_t stream) {
    TORCH_CHECK(clusters * cs <= INT32_MAX, "ddpm::fused_sample: this batch needs more thread blocks than one "
                "launch allows (", clusters * cs, ")");
    config.gridDim = dim3(static_cast<unsigned>(clusters * cs));
    config.blockDim = dim3(threads);
    config.dynamicSmemBytes = smem;
    config.stream = stream;
    attribute.id = cudaLaunchAttributeClusterDimension;
    attribute.val.clusterDim.x = static_cast<unsigned>(cs);
    attribute.val.clusterDim.y = 1;
    attribute.val.clusterDim.z = 1;
    config.attrs = &attribute;
    config.numAttrs = 1;
  }
  ClusterLaunch(const ClusterLaunch&) = delete;
  ClusterLaunch& operator=(const ClusterLaunch&) = delete;
};

const DeviceInfo& device_info(int device) {
  static std::mutex mutex;
  static std::vector<DeviceInfo> cache(64);
  std::lock_guard<std::mutex> lock(mutex);
  TORCH_CHECK(device < static_cast<int>(cache.size()), "ddpm::fused_sample: device index ", device,
              " is beyond the supported 64 devices");
  if (cache[device].sm_count != 0) return cache[device];
  // Filled in a local and cached only when complete: a failed query is retried.
  DeviceInfo info;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&info.sm_count, cudaDevAttrMultiProcessorCount, device));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&info.max_smem, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
#ifdef DDPM_OPS_SM90A  // setup.py: the extension's sm_90 code was built as sm_90a
  int major = 0, minor = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device));
  info.wgmma = major == 9 && minor == 0;
#endif
  // Every cluster instantiation uses the same block size and (at most) all of
  // the shared memory, so one of them answers for all.
  auto kernel = cuda_kernels::cluster_sample_kernel<1>;
  prepare_kernel(kernel, device, info.max_smem, true);
  for (int size = 1; size <= kMaxClusterSize; ++size) {
    const ClusterLaunch launch(1, size, cuda_kernels::kClusterThreads, info.max_smem, nullptr);
    int clusters = 0;
    if (cudaOccupancyMaxActiveClusters(&clusters, kernel, &launch.config) != cudaSuccess) {
      (void)cudaGetLastError();  // an unsupported size is an answer, not an error
      clusters = 0;
    }
    info.max_clusters[size] = clusters;
  }
  TORCH_CHECK(info.max_clusters[1] > 0, "ddpm::fused_sample: the cluster kernel does not fit on device ",
              device);
  cache[device] = info;
  return cache[device];
}

int round_up(int v, int m) { return (v + m - 1) / m * m; }

// Read per call, like the other switches, so that tests can set them.
bool log_plans() { return std::getenv("DDPM_OPS_CUDA_LOG") != nullptr; }

// The driver's tensor-map encoder, through the runtime (no link against
// libcuda); null where the driver lacks it.
PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  static const PFN_cuTensorMapEncodeTiled_v12000 encode = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &found) !=
            cudaSuccess ||
        found != cudaDriverEntryPointSuccess) {
      (void)cudaGetLastError();
      fn = nullptr;
    }
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
  }();
  return encode;
}

// Whether the tiled kernel takes its weight chunks from the TMA unit (for the
// layers it can address): unless DDPM_OPS_CUDA_TMA=0. Measured on the H200
// (BENCHMARKS.md), TMA is 5-12% faster than cp.async at every tile height
// (fewer instructions per chunk, none of them on the compute warps).
bool use_tma() {
  if (tensor_map_encoder() == nullptr) return false;
  const char* forced = std::getenv("DDPM_OPS_CUDA_TMA");
  return forced == nullptr || std::strcmp(forced, "0") != 0;
}

// TileMaps::weight[l] for every layer the plan copies by TMA; a layer whose
// descriptor the driver refuses falls back to cp.async.
void make_tile_maps(const SampleArgs& a, TilePlan* plan, TileMaps* maps) {
  *maps = {};
  for (int l = 0; l < a.num_layers; ++l) {
    if (!plan->tma[l]) continue;
    const cuda_kernels::LayerArgs& la = a.layers[l];
    const cuuint64_t dims[2] = {static_cast<cuuint64_t>(la.in), static_cast<cuuint64_t>(la.out)};
    const cuuint64_t row_bytes[1] = {static_cast<cuuint64_t>(la.in) * sizeof(float)};
    const cuuint32_t box[2] = {cuda_kernels::kTileKChunk,
                               static_cast<cuuint32_t>(cuda_kernels::tile_pass_cols(*plan, l))};
    const cuuint32_t element_strides[2] = {1, 1};
    const CUresult result = tensor_map_encoder()(
        &maps->weight[l], CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 2, const_cast<float*>(la.weight), dims, row_bytes,
        box, element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
        CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    plan->tma[l] = result == CUDA_SUCCESS;
  }
}

// The tiled kernel's plan for 16 * mt rows in clusters of cs CTAs: how the
// CTAs share each layer's work and the shared-memory layout, with the last
// layer split over its inner dimension (TilePlan::split_last) if try_split
// and the shape allows, and chunks by TMA for the layers it can address if
// tma_chunks. Returns the shared memory the plan needs.
size_t plan_tiled_layout(const SampleArgs& a, int mt, int cs, bool try_split, bool tma_chunks, TilePlan* plan) {
  using cuda_kernels::kTileKChunk;
  using cuda_kernels::kTileMaxWarpTiles;
  using cuda_kernels::kTileWarps;
  const int L = a.num_layers;
  const int rows = 16 * mt;
  int widest = a.dim + 1;
  for (int l = 0; l < L; ++l) widest = std::max(widest, a.layers[l].out);
  int act_width = round_up(widest, kTileKChunk);
  *plan = {};
  plan->cluster_size = cs;
  for (int l = 0; l < L; ++l) {
    plan->cta_cols[l] = round_up((a.layers[l].out + cs - 1) / cs, 8);
  }
  // Splitting the last layer's inner dimension saves an exchange of the
  // widest activations per step, and the last layer (dim wide) then keeps
  // every CTA busy. Each CTA's inner range is whole chunks (so layer L - 2's
  // shares are), inside the activation rows (which may have to widen).
  const bool split = try_split && cs > 1 && L >= 2;
  plan->split_last = split;
  if (split) {
    plan->cta_cols[L - 2] = round_up((a.layers[L - 2].out + cs - 1) / cs, kTileKChunk);
    act_width = std::max(act_width, cs * plan->cta_cols[L - 2]);
  }
  const int partial_ld = cuda_kernels::round_up4(a.dim);
  const size_t partial_floats = static_cast<size_t>(cs) * rows * partial_ld;
  if (split) plan->cta_cols[L - 1] = round_up(a.dim, 8);
  int widest_pass = 0;
  for (int l = 0; l < L; ++l) {
    const cuda_kernels::LayerArgs& la = a.layers[l];
    plan->vec4[l] = la.in % 4 == 0 && reinterpret_cast<uintptr_t>(la.weight) % 16 == 0;
    // TMA needs the same: a 16-byte aligned matrix with 16-byte row strides.
    plan->tma[l] = tma_chunks && plan->vec4[l];
    // The fewest passes that cover the CTA's share, and the fewest tiles per
    // warp for them: every warp gets work in a narrow share (the last layer
    // is dim wide), and a share of 192 columns takes 3 tiles per warp rather
    // than 4 on 6 warps (a pass is as slow as its busiest warp).
    const int warp_cols = kTileWarps * 8;
    const int passes = (plan->cta_cols[l] + warp_cols * kTileMaxWarpTiles - 1) / (warp_cols * kTileMaxWarpTiles);
    plan->warp_tiles[l] = (plan->cta_cols[l] + passes * warp_cols - 1) / (passes * warp_cols);
    widest_pass = std::max(widest_pass, cuda_kernels::tile_pass_cols(*plan, l));
  }
  // Narrow passes leave room for more chunks in flight.
  plan->slot_floats = widest_pass * cuda_kernels::kTileStageLd;
  plan->slots = cuda_kernels::kTileMaxSlots;  // a power of two (the ring's index wraps by a mask)
  while (plan->slots * plan->slot_floats > cuda_kernels::kTileStageFloats) plan->slots /= 2;
  const int ld = act_width + 4;
  plan->act_ld = ld;
  plan->act_offset[0] = 0;
  plan->act_offset[1] = rows * ld;
  plan->x_offset = 2 * rows * ld;
  // 16-byte aligned for cp.async 16
  plan->stage_offset = round_up(plan->x_offset + rows * a.dim, 4);
  plan->t_offset = plan->stage_offset + cuda_kernels::kTileStageFloats +
                   static_cast<int>(cuda_kernels::kTileSwizzleBytes / sizeof(float));
  plan->valid_offset = plan->t_offset + rows;
  plan->coef_offset = plan->valid_offset + rows;
  plan->barrier_offset = round_up(plan->coef_offset + 2 * rows, 4);
  const int end = plan->barrier_offset + 2 * (2 + cuda_kernels::kTileMaxSlots);  // 8-byte mbarriers
  if (!split) return static_cast<size_t>(end) * sizeof(float);
  plan->partial_offset = end;  // 16-byte aligned for the stores
  plan->partial_ld = partial_ld;
  return (plan->partial_offset + partial_floats) * sizeof(float);
}

// plan_tiled_layout, with the split last layer only where it fits in max_smem.
size_t plan_tiled(const SampleArgs& a, int mt, int cs, size_t max_smem, TilePlan* plan) {
  const bool tma = use_tma();
  const size_t smem = plan_tiled_layout(a, mt, cs, true, tma, plan);
  return smem <= max_smem || !plan->split_last ? smem : plan_tiled_layout(a, mt, cs, false, tma, plan);
}

// DDPM_OPS_CUDA_CLUSTER_SIZE (tests, benchmarks), when that size launches;
// otherwise 0.
int forced_cluster_size(const DeviceInfo& info) {
  if (const char* forced = std::getenv("DDPM_OPS_CUDA_CLUSTER_SIZE")) {
    const int size = std::atoi(forced);
    if (size >= 1 && size <= kMaxClusterSize && info.max_clusters[size] > 0) return size;
  }
  return 0;
}

// The tiled kernel's launch: 16 * mt rows per tile, clusters of cs CTAs.
// mt == 0: use the cluster kernel.
struct TiledChoice {
  int mt = 0;
  int cs = 1;
};

// The rule, read off every variant forced on the H200 (bench.py --variants,
// BENCHMARKS.md):
//   - from batch kTiledMinBatch, 64-row tiles, one CTA each, once they fill
//     7/8 of the multiprocessors (fewest weight reads per row; seed shape,
//     batch 8192, 128 tiles on 132: 793 us against 893 in 16-row tiles);
//   - otherwise, from batch kTiledMinBatch, or from batch kStreamedMinBatch
//     for a net whose weights the cluster kernel cannot keep on chip (it
//     would read them from L2 at CUDA-core speed): 16-row tiles, each
//     layer's columns split over the largest cluster (up to 16, any size) of
//     which every tile's cluster is resident at once: a CTA's share of the
//     weight stream, the bound at these sizes, shrinks with the cluster, and
//     a second wave would double the time. (Seed shape, 16-row tiles against
//     32- and 64-row tiles: batch 1024 271 us in clusters of 2 against 480
//     and 783, batch 6144 752 against 947 and 788.)
//   - otherwise the cluster kernel.
TiledChoice choose_tiled(const SampleArgs& a, const DeviceInfo& info, bool weights_on_chip) {
  TiledChoice choice;
  const char* forced = std::getenv("DDPM_OPS_CUDA_KERNEL");
  const int forced_cs = forced_cluster_size(info);
  auto fits = [&](int mt) {
    TilePlan plan;
    return plan_tiled(a, mt, 1, info.max_smem, &plan) <= static_cast<size_t>(info.max_smem);
  };
  auto tiles = [&](int mt) { return (static_cast<int64_t>(a.batch) + 16 * mt - 1) / (16 * mt); };
  if (forced != nullptr && std::strcmp(forced, "cluster") == 0) return choice;
  for (int mt : {1, 2, 4}) {
    if (forced != nullptr && std::strcmp(forced, ("tiled" + std::to_string(16 * mt)).c_str()) == 0) {
      if (fits(mt)) {  // else the cluster kernel
        choice.mt = mt;
        choice.cs = std::max(forced_cs, 1);
      }
      return choice;
    }
  }
  if (a.batch >= kTiledMinBatch && fits(4) && 8 * tiles(4) >= 7 * info.sm_count) choice.mt = 4;
  const bool streamed = a.batch >= kStreamedMinBatch && !weights_on_chip;
  if (choice.mt == 0 && (streamed || a.batch >= kTiledMinBatch) && fits(1)) {
    choice.mt = 1;
    for (int size = kMaxClusterSize; size > 1; --size) {
      if (tiles(1) <= info.max_clusters[size]) {
        choice.cs = size;
        break;
      }
    }
  }
  if (choice.mt != 0 && forced_cs > 0) choice.cs = forced_cs;
  return choice;
}

// Shared memory (floats) for layer l's weight slice on one CTA of a cluster of
// cs: padded rows and the bias slice.
size_t slice_floats(const SampleArgs& a, int l, int cs) {
  using cuda_kernels::round_up4;
  const int s = cuda_kernels::slice_size(a.layers[l].out, cs);
  return static_cast<size_t>(s) * round_up4(a.layers[l].in) + round_up4(s);
}

size_t all_slices_floats(const SampleArgs& a, int cs) {
  size_t floats = 0;
  for (int l = 0; l < a.num_layers; ++l) floats += slice_floats(a, l, cs);
  return floats;
}

// Shared memory (floats) per row of the cluster kernel: layer-0 input, two
// hidden buffers, two eps buffers, x, (c1, c2), t and valid; each region is
// rounded up to 4 floats, and the mbarriers take 8 more, hence the + 28.
size_t row_floats(const SampleArgs& a) {
  using cuda_kernels::round_up4;
  int hidden = 0;
  for (int l = 0; l + 1 < a.num_layers; ++l) hidden = std::max(hidden, a.layers[l].out);
  return static_cast<size_t>(round_up4(a.dim + 1)) + 2 * round_up4(hidden) +
         2 * round_up4(a.dim) + a.dim + 4 + 28;
}

// Whether the cluster kernel keeps every weight on chip: the slices of a
// 2-CTA cluster fit next to one row.
bool cluster_weights_on_chip(const SampleArgs& a, const DeviceInfo& info) {
  return all_slices_floats(a, 2) + row_floats(a) <= info.max_smem / sizeof(float);
}

// log2 of the cluster size. The rule was read off every size forced on the
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
// 4.
// DDPM_OPS_CUDA_CLUSTER_SIZE (tests, benchmarks) forces a size that launches
// (a power of two: the kernel's exchange indexes CTAs by bit masks).
// Falls back to the largest size below the choice that launches.
int cluster_size_log2(const SampleArgs& a, const DeviceInfo& info) {
  const int forced = forced_cluster_size(info);
  if (forced > 0 && (forced & (forced - 1)) == 0) return __builtin_ctz(forced);
  auto row_per_cluster = [&](int size) { return a.batch <= info.max_clusters[size]; };
  int want;
  if (cluster_weights_on_chip(a, info)) {
    want = row_per_cluster(8) ? 8 : (row_per_cluster(4) ? 4 : (a.batch <= 512 ? 2 : 4));
  } else if (row_per_cluster(16)) {
    want = 16;
  } else {
    want = a.batch <= 32 ? 8 : (a.batch <= 64 ? 16 : (a.batch <= 256 ? 8 : 4));
  }
  int chosen = 0;
  for (int i = 0; (1 << i) <= want; ++i) {
    if (info.max_clusters[1 << i] > 0) chosen = i;
  }
  return chosen;
}

// The work split of one layer with `cols` output columns per CTA over `rows`
// rows, for the kernel instantiation whose warp tiles have vr rows: the
// narrowest column tile (2 to 16 columns, at most 32 outputs) that gives
// every warp at most one tile, or the widest: a warp's tiles run one after
// the other, each a dependent chain of loads, products and shuffles, so one
// tile per warp is the shortest layer.
cuda_kernels::LayerSplit make_split(int cols, int rows, int vr) {
  using cuda_kernels::kClusterWarps;
  cuda_kernels::LayerSplit sp = {};
  sp.cols = cols;
  const int row_tiles = (rows + vr - 1) / vr;
  const int widest_log2 = cuda_kernels::cluster_widest_vc_log2(vr);
  int vc_log2 = 1;
  auto tiles_c = [&](int log2) { return std::max(1, (cols + (1 << log2) - 1) >> log2); };
  while (vc_log2 < widest_log2 && row_tiles * tiles_c(vc_log2) > kClusterWarps) ++vc_log2;
  sp.vc_log2 = vc_log2;
  sp.tiles_c = tiles_c(vc_log2);
  sp.tiles_c_magic = cuda_kernels::magic_divisor(sp.tiles_c);
  sp.ntiles = row_tiles * sp.tiles_c;
  return sp;
}

void launch_cluster(const SampleArgs& a, const DeviceInfo& info, int device, cudaStream_t stream) {
  using cuda_kernels::round_up4;
  using cuda_kernels::slice_size;
  const int size_log2 = cluster_size_log2(a, info);
  const int cs = 1 << size_log2;
  const int max_clusters = info.max_clusters[cs];
  const int L = a.num_layers;
  ClusterPlan p = {};
  p.cluster_size = cs;
  int hidden = 0;
  for (int l = 0; l + 1 < L; ++l) hidden = std::max(hidden, a.layers[l].out);
  p.in0_ld = round_up4(a.dim + 1);
  p.hidden_ld = round_up4(hidden);
  p.eps_ld = round_up4(a.dim);
  const size_t weight_floats = all_slices_floats(a, cs);
  const size_t per_row = row_floats(a);
  const size_t budget = info.max_smem / sizeof(float);
  // Spread the batch over all co-resident clusters. If that leaves too little
  // room for the weights but 8 rows would not, shrink the tile (down to 8
  // rows) so the weights stay on chip; then shrink while even the
  // activations do not fit.
  const int64_t per_cluster = (static_cast<int64_t>(a.batch) + max_clusters - 1) / max_clusters;
  int rows = static_cast<int>(std::min<int64_t>(per_cluster, kMaxClusterRows));
  if (8 * per_row + weight_floats <= budget) {
    while (rows > 8 && rows * per_row + weight_floats > budget) rows /= 2;
  }
  while (rows > 1 && rows * per_row > budget) rows /= 2;
  TORCH_CHECK(rows * per_row <= budget, "ddpm::fused_sample: dim ", a.dim,
              " and the hidden widths need more shared memory per sample than the GPU has (",
              info.max_smem, " bytes per block)");
  p.rows_per_tile = rows;
  // Rows of a warp's output tile: every weight load serves them all.
  const int vr = rows <= 2 ? rows : 4;
  void (*kernel)(SampleArgs, ClusterPlan) = vr == 1   ? cuda_kernels::cluster_sample_kernel<1>
                                            : vr == 2 ? cuda_kernels::cluster_sample_kernel<2>
                                                      : cuda_kernels::cluster_sample_kernel<4>;
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
  p.barrier_offset = take(2 * cuda_kernels::kExchangeBuffers);
  TORCH_CHECK(static_cast<size_t>(offset) <= budget, "ddpm::fused_sample: dim ", a.dim,
              " and the hidden widths need more shared memory per sample than the GPU has (",
              info.max_smem, " bytes per block)");
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
    p.last_split = make_split(a.dim, rows, vr);
  }
  // Weight slices that fit stay in shared memory; the rest are read from
  // global memory (L2).
  for (int l = 0; l < L; ++l) {
    if (replicate && l == L - 1) {
      p.weight_offset[l] = -1;
      p.bias_offset[l] = -1;
      continue;
    }
    const int s = slice_size(a.layers[l].out, cs);
    const bool on_chip = offset + slice_floats(a, l, cs) <= budget;
    if (on_chip) {
      p.weight_offset[l] = take(s * round_up4(a.layers[l].in));
      p.bias_offset[l] = take(s);
    } else {
      p.weight_offset[l] = -1;
      p.bias_offset[l] = -1;
    }
    p.split[l] = make_split(s, rows, vr);
  }
  const size_t smem = static_cast<size_t>(offset) * sizeof(float);
  const int64_t tiles = (static_cast<int64_t>(a.batch) + rows - 1) / rows;
  if (log_plans()) {
    std::fprintf(stderr,
                 "ddpm_ops cluster kernel: batch %d, cluster size %d (%d co-resident), %d rows x "
                 "%lld clusters, last layer %s, %zu bytes shared memory, weights on chip:",
                 a.batch, cs, max_clusters, rows, static_cast<long long>(tiles), replicate ? "whole per CTA" : "sliced",
                 smem);
    for (int l = 0; l < L; ++l) std::fprintf(stderr, " %d", p.weight_offset[l] >= 0 || (replicate && l == L - 1));
    std::fprintf(stderr, "\n");
  }

  prepare_kernel(kernel, device, info.max_smem, true);
  const ClusterLaunch launch(tiles, cs, cuda_kernels::kClusterThreads, smem, stream);
  C10_CUDA_CHECK(cudaLaunchKernelEx(&launch.config, kernel, a, p));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <int MT>
void launch_tiled(const SampleArgs& a, int cs, Precision precision, const DeviceInfo& info, int device,
                  cudaStream_t stream) {
  TilePlan p;
  const size_t smem = plan_tiled(a, MT, cs, info.max_smem, &p);
  TileMaps maps;
  make_tile_maps(a, &p, &maps);
  void (*kernel)(SampleArgs, TilePlan, TileMaps) = precision == Precision::kFloat32
                                                       ? cuda_kernels::tiled_sample_kernel<MT, 3>
                                                       : cuda_kernels::tiled_sample_kernel<MT, 1>;
  prepare_kernel(kernel, device, info.max_smem, true);
  const int64_t tiles = (static_cast<int64_t>(a.batch) + 16 * MT - 1) / (16 * MT);
  if (log_plans()) {
    std::fprintf(stderr,
                 "ddpm_ops tiled kernel: batch %d, %d rows x %lld tiles, cluster size %d, last layer %s, "
                 "%d chunks in flight, %s, %zu bytes shared memory, weight chunks by:",
                 a.batch, 16 * MT, static_cast<long long>(tiles), cs,
                 p.split_last ? "split over its inner dimension" : "split over its columns", p.slots - 1,
                 precision == Precision::kFloat32 ? "3xTF32" : "tf32", smem);
    for (int l = 0; l < a.num_layers; ++l) std::fprintf(stderr, " %s", p.tma[l] ? "tma" : "cp.async");
    std::fprintf(stderr, "\n");
  }
  const ClusterLaunch launch(tiles, cs, cuda_kernels::kTileThreads, smem, stream);
  C10_CUDA_CHECK(cudaLaunchKernelEx(&launch.config, kernel, a, p, maps));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// The wgmma kernel's padded hidden width for this net (64, 128, 192 or 256),
// or 0 where it cannot run it: it needs a hidden layer, dim <= 64, hidden
// widths <= 256 and the bf16 net within shared memory (wgmma_kernel.cuh).
int wgmma_hidden(const SampleArgs& a, const DeviceInfo& info) {
  using cuda_kernels::kWgmmaCols;
  if (!info.wgmma || a.num_layers < 2 || a.dim > cuda_kernels::kWgmmaDimPad) return 0;
  int widest = 0;
  for (int l = 0; l + 1 < a.num_layers; ++l) widest = std::max(widest, a.layers[l].out);
  const int h = round_up(widest, kWgmmaCols);
  const bool fits = cuda_kernels::WgmmaLayout{h, a.num_layers}.bytes() <= info.max_smem;
  return h <= 4 * kWgmmaCols && fits ? h : 0;
}

template <int H>
void launch_wgmma(const SampleArgs& a, const DeviceInfo& info, int device, cudaStream_t stream) {
  using cuda_kernels::kWgmmaRows;
  const cuda_kernels::WgmmaLayout layout{H, a.num_layers};
  const int64_t tiles = (static_cast<int64_t>(a.batch) + kWgmmaRows - 1) / kWgmmaRows;
  const int grid = static_cast<int>(std::min<int64_t>(info.sm_count, tiles));
  const int smem = cuda_kernels::wgmma_request(layout, info.max_smem);
  auto kernel = cuda_kernels::wgmma_sample_kernel<H>;
  prepare_kernel(kernel, device, info.max_smem, false);
  if (log_plans()) {
    std::fprintf(stderr,
                 "ddpm_ops wgmma kernel: batch %d, %d rows x %lld tiles on %d CTAs of %d warpgroups, "
                 "hidden width %d, %d bytes shared memory\n",
                 a.batch, kWgmmaRows, static_cast<long long>(tiles), grid, cuda_kernels::kWgmmaWarpgroups, H, smem);
  }
  kernel<<<grid, cuda_kernels::kWgmmaThreads, smem, stream>>>(a);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// The split kernel's shape for this call: kOwn columns of each hidden layer
// per CTA in clusters of cs (own = 0 where it cannot run the net). It needs
// the bf16 kernel's envelope (a hidden layer, dim <= 64, hidden widths <=
// 256) and both bf16 planes of a CTA's share, and the exchange buffer, within
// shared memory. Of the shapes that hold the net it takes the one with the
// least time, waves of tiles times a step's, the smaller cluster on a tie:
// clusters of 4 while the tiles fit in one wave of them, a cluster of 1
// where the whole net fits one CTA and the tiles fill the GPU.
// DDPM_OPS_CUDA_CLUSTER_SIZE forces the cluster size where a shape of that
// size holds the net (and is ignored elsewhere).
struct SplitShape {
  int own = 0;
  int cs = 0;
};

SplitShape split_shape(const SampleArgs& a, const DeviceInfo& info) {
  if (!info.wgmma || a.num_layers < 2 || a.dim > cuda_kernels::kWgmmaDimPad) return {};
  int widest = 0;
  for (int l = 0; l + 1 < a.num_layers; ++l) widest = std::max(widest, a.layers[l].out);
  const int64_t tiles = (static_cast<int64_t>(a.batch) + cuda_kernels::kWgmmaRows - 1) / cuda_kernels::kWgmmaRows;
  // The best shape in clusters of `only` (0: any size).
  auto best_shape = [&](int only) {
    SplitShape best;
    int64_t best_work = 0;
    for (const SplitShape shape :
         {SplitShape{64, 1}, SplitShape{128, 1}, SplitShape{64, 2}, SplitShape{128, 2}, SplitShape{64, 4}}) {
      const cuda_kernels::SplitLayout layout{shape.own, shape.cs, a.num_layers};
      const int clusters = info.max_clusters[shape.cs];
      if (layout.hidden() < widest || layout.bytes() > info.max_smem || clusters == 0) continue;
      if (only != 0 && shape.cs != only) continue;
      const int64_t work = (tiles + clusters - 1) / clusters * (shape.own + kSplitStepColumns);
      if (best.own == 0 || work < best_work) {
        best = shape;
        best_work = work;
      }
    }
    return best;
  };
  const int forced_cs = forced_cluster_size(info);
  const SplitShape forced = forced_cs != 0 ? best_shape(forced_cs) : SplitShape{};
  return forced.own != 0 ? forced : best_shape(0);
}

// Two exchange buffers where they fit (no cluster barrier per exchange;
// ClusterLink), else one.
template <int kOwn, int kCs>
void launch_split(const SampleArgs& a, const DeviceInfo& info, int device, cudaStream_t stream) {
  using cuda_kernels::kWgmmaRows;
  const cuda_kernels::SplitLayout double_buffered{kOwn, kCs, a.num_layers, 2};
  const bool two = kCs > 1 && double_buffered.bytes() <= info.max_smem;
  const cuda_kernels::SplitLayout layout{kOwn, kCs, a.num_layers, two ? 2 : 1};
  const int64_t tiles = (static_cast<int64_t>(a.batch) + kWgmmaRows - 1) / kWgmmaRows;
  const int64_t clusters = std::min<int64_t>(info.max_clusters[kCs], tiles);
  const int smem = cuda_kernels::wgmma_request(layout, info.max_smem);
  auto kernel = cuda_kernels::split_sample_kernel<kOwn, kCs, 1>;
  if constexpr (kCs > 1) {
    if (two) kernel = cuda_kernels::split_sample_kernel<kOwn, kCs, 2>;
  }
  prepare_kernel(kernel, device, info.max_smem, true);
  if (log_plans()) {
    std::fprintf(stderr,
                 "ddpm_ops split kernel: batch %d, %d rows x %lld tiles on %lld clusters of %d, "
                 "hidden width %d, %d columns per CTA, %d bytes shared memory, %d exchange buffers\n",
                 a.batch, kWgmmaRows, static_cast<long long>(tiles), static_cast<long long>(clusters), kCs,
                 layout.hidden(), kOwn, smem, layout.buffers);
  }
  const ClusterLaunch launch(clusters, kCs, cuda_kernels::kSplitThreads, smem, stream);
  C10_CUDA_CHECK(cudaLaunchKernelEx(&launch.config, kernel, a));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// Whether this call runs the split kernel (shape *shape): from batch
// kSplitMinBatch wherever it can, whatever the precision (it is exact, and
// faster there than the tiled kernel's tf32 products; "bf16" takes the
// wgmma kernel first), at any batch where DDPM_OPS_CUDA_KERNEL=split forces
// it, never where it forces another kernel.
bool use_split(const SampleArgs& a, const DeviceInfo& info, SplitShape* shape) {
  *shape = split_shape(a, info);
  const char* forced = std::getenv("DDPM_OPS_CUDA_KERNEL");
  if (forced != nullptr) return shape->own != 0 && std::strcmp(forced, "split") == 0;
  return shape->own != 0 && a.batch >= kSplitMinBatch;
}

// The narrow kernel's shape for this call (narrow_kernel.cuh): kOwn columns
// of each hidden layer per CTA in clusters of cs, tiles of `rows` rows (own =
// 0 where it does not run the call). It needs the split kernel's envelope,
// the CTA's share within the shared memory, and (unless forced) one wave of
// clusters that holds the batch: a second wave would double the time, and
// there the split kernel's 64-row tiles are faster (seed shape, batch 1024:
// 94.5 us against 99.4 in two waves of 8-row tiles in clusters of 2). Of
// those shapes it takes the one of least narrow_step_cost.
// DDPM_OPS_CUDA_CLUSTER_SIZE and DDPM_OPS_CUDA_TILE_ROWS force the cluster
// size and the tile's rows where a shape of them holds the net (then in any
// number of waves; ignored elsewhere).
struct NarrowShape {
  int own = 0;
  int cs = 0;
  int rows = 0;
};

// A step's time, in units of about 1/8 us at the seed shape's 16 steps,
// fitted to the H200's graph-replayed gpu us (docs/kernels.md):
// the bytes a CTA receives per step (rows x (cs - 1)) and the weights it
// reads per step (own) bound it. Seed shape, one wave: 42.5 us in clusters
// of 4 with 8-row tiles (model 328), 56.4 to 58.4 with 16 (448), 68.4 to
// 73.6 with 24 (568), 79.9 to 83.0 with 32 (688); 56.7 in clusters of 2
// with 8 (440).
int64_t narrow_step_cost(const NarrowShape& s) { return 5 * s.rows * (s.cs - 1) + 3 * s.own + 16; }

NarrowShape narrow_shape(const SampleArgs& a, const DeviceInfo& info) {
  if (!info.wgmma || a.num_layers < 2 || a.dim > cuda_kernels::kWgmmaDimPad) return {};
  int widest = 0;
  for (int l = 0; l + 1 < a.num_layers; ++l) widest = std::max(widest, a.layers[l].out);
  const int forced_cs = forced_cluster_size(info);
  const char* forced_rows_env = std::getenv("DDPM_OPS_CUDA_TILE_ROWS");
  const int forced_rows = forced_rows_env != nullptr ? std::atoi(forced_rows_env) : 0;
  // The cheapest shape in clusters of only_cs with tiles of only_rows (0:
  // any), in one wave unless any_waves.
  auto best_shape = [&](int only_cs, int only_rows, bool any_waves) {
    NarrowShape best;
    int64_t best_work = 0;
    for (const auto own_cs : {std::pair<int, int>{64, 1}, {128, 1}, {64, 2}, {128, 2}, {64, 4}}) {
      for (int rows : {8, 16, 24, 32}) {
        const NarrowShape shape{own_cs.first, own_cs.second, rows};
        const cuda_kernels::NarrowLayout layout{shape.own, shape.cs, a.num_layers, rows};
        const int clusters = info.max_clusters[shape.cs];
        if (layout.hidden() < widest || layout.bytes() + cuda_kernels::kWgmmaAlign > info.max_smem ||
            clusters == 0)
          continue;
        if ((only_cs != 0 && shape.cs != only_cs) || (only_rows != 0 && rows != only_rows)) continue;
        const int64_t waves = ((static_cast<int64_t>(a.batch) + rows - 1) / rows + clusters - 1) / clusters;
        if (waves > 1 && !any_waves) continue;
        const int64_t work = waves * narrow_step_cost(shape);
        if (best.own == 0 || work < best_work) {
          best = shape;
          best_work = work;
        }
      }
    }
    return best;
  };
  const bool forced = forced_cs != 0 || forced_rows != 0;
  const NarrowShape forced_shape = forced ? best_shape(forced_cs, forced_rows, true) : NarrowShape{};
  return forced_shape.own != 0 ? forced_shape : best_shape(0, 0, false);
}

template <int kOwn, int kCs, int kN>
void launch_narrow(const SampleArgs& a, const DeviceInfo& info, int device, cudaStream_t stream) {
  const cuda_kernels::NarrowLayout layout{kOwn, kCs, a.num_layers, kN};
  const int64_t tiles = (static_cast<int64_t>(a.batch) + kN - 1) / kN;
  const int64_t clusters = std::min<int64_t>(info.max_clusters[kCs], tiles);
  const int smem = cuda_kernels::wgmma_request(layout, info.max_smem);
  auto kernel = cuda_kernels::narrow_sample_kernel<kOwn, kCs, kN>;
  prepare_kernel(kernel, device, info.max_smem, true);
  if (log_plans()) {
    std::fprintf(stderr,
                 "ddpm_ops narrow kernel: batch %d, %d rows x %lld tiles on %lld clusters of %d, "
                 "hidden width %d, %d columns per CTA, %d bytes shared memory\n",
                 a.batch, kN, static_cast<long long>(tiles), static_cast<long long>(clusters), kCs,
                 layout.hidden(), kOwn, smem);
  }
  const ClusterLaunch launch(clusters, kCs, cuda_kernels::kNarrowThreads, smem, stream);
  C10_CUDA_CHECK(cudaLaunchKernelEx(&launch.config, kernel, a));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <int kOwn, int kCs>
void launch_narrow_rows(const SampleArgs& a, int rows, const DeviceInfo& info, int device, cudaStream_t stream) {
  switch (rows) {
    case 8:
      return launch_narrow<kOwn, kCs, 8>(a, info, device, stream);
    case 16:
      return launch_narrow<kOwn, kCs, 16>(a, info, device, stream);
    case 24:
      return launch_narrow<kOwn, kCs, 24>(a, info, device, stream);
    default:
      return launch_narrow<kOwn, kCs, 32>(a, info, device, stream);
  }
}

void launch_narrow_shape(const SampleArgs& a, const NarrowShape& s, const DeviceInfo& info, int device,
                         cudaStream_t stream) {
  if (s.cs == 1) {
    if (s.own == 64) return launch_narrow_rows<64, 1>(a, s.rows, info, device, stream);
    return launch_narrow_rows<128, 1>(a, s.rows, info, device, stream);
  }
  if (s.cs == 2) {
    if (s.own == 64) return launch_narrow_rows<64, 2>(a, s.rows, info, device, stream);
    return launch_narrow_rows<128, 2>(a, s.rows, info, device, stream);
  }
  launch_narrow_rows<64, 4>(a, s.rows, info, device, stream);
}

// Whether this call runs the narrow kernel (shape *shape): from batch
// kNarrowMinBatch wherever one wave of it holds the batch, whatever the
// precision (it is exact, and faster there than the split and tiled
// kernels; "bf16" takes the wgmma kernel first), at any batch where
// DDPM_OPS_CUDA_KERNEL=narrow forces it, never where it forces another
// kernel.
bool use_narrow(const SampleArgs& a, const DeviceInfo& info, NarrowShape* shape) {
  *shape = narrow_shape(a, info);
  const char* forced = std::getenv("DDPM_OPS_CUDA_KERNEL");
  if (forced != nullptr) return shape->own != 0 && std::strcmp(forced, "narrow") == 0;
  return shape->own != 0 && a.batch >= kNarrowMinBatch;
}

// Whether this call runs the wgmma kernel (with hidden width *h): for "bf16"
// from batch kWgmmaMinBatch wherever it can, but where the split kernel
// would run in clusters of 4 (its tiles in one wave of them): there it and
// the narrow kernel are exact and faster (H200, seed shape, batch 512: 93
// and 57 against 120 gpu us); at any batch
// where DDPM_OPS_CUDA_KERNEL=wgmma forces it, never where it forces another
// kernel.
bool use_wgmma(const SampleArgs& a, Precision precision, const DeviceInfo& info, int* h) {
  *h = precision == Precision::kBFloat16 ? wgmma_hidden(a, info) : 0;
  const char* forced = std::getenv("DDPM_OPS_CUDA_KERNEL");
  if (forced != nullptr) return *h != 0 && std::strcmp(forced, "wgmma") == 0;
  return *h != 0 && a.batch >= kWgmmaMinBatch && split_shape(a, info).cs != 4;
}

// The resident kernel's shape for this call (resident_kernel.cuh): kOpw
// outputs of every hidden layer per warp, so clusters of H / (8 kOpw) CTAs,
// and `rows` rows per cluster (opw = 0 where it does not run the call). It
// needs 2 to 4 layers, dim <= 64 and every hidden layer H <= 256 wide, a
// multiple of 8 kOpw; the weights of every layer but the first 16-byte
// aligned (as torch allocates them); and every cluster resident at once (a
// second wave would double the time) with at most 8 rows each (kOpw = 2, 4
// or 16 and the rows within the registers: resident_fits). Of the shapes
// that do, the one with the fewest products per lane (rows x kOpw),
// clusters of 16 only where no other shape runs the call; on a tie, for
// calls of at least kResidentManySteps steps the fewer rows per cluster
// (each step is cheaper), for shorter ones the fewer outputs per warp (fewer
// weights to load per CTA: about 6 us at 16 outputs per warp). H200,
// graph-replayed gpu us (docs/kernels.md), seed shape (16
// steps): batch 1 20.6 in clusters of 8 (1 x 4), 25.1 in clusters of 16
// (1 x 2); batch 16 25.2 in clusters of 8 (2 x 4), 31.6 in clusters of 2
// (1 x 16); batch 60 36.2 in clusters of 8 (4 x 4), 32.2 in clusters of 2
// (1 x 16; 25.9 since the last layer's reads lost their bank conflicts);
// batch 64 26.0 in clusters of 2, 56.9 in clusters of 8 (8 x 4). Dim 12
// (5 steps), batch 60: 12.0 in clusters of 8 (4 x 4), 13.4 in clusters of
// 2 (1 x 16; since then 11.8 and 11.3: the short-call tie may now go the
// other way, BENCHMARKS.md's leads).
// Hidden width 128, 4 layers, 10 steps, batch 16 (at a53176e, before the
// float4 weight loads): 17.3 in clusters of 4 (1 x 4), 20.1 in clusters of
// 8 (2 x 2).
// DDPM_OPS_CUDA_CLUSTER_SIZE forces the cluster size where a shape of that
// size runs the call (and is ignored elsewhere).
constexpr int kResidentManySteps = 8;

struct ResidentShape {
  int opw = 0;
  int rows = 0;
  int cs = 0;
};

ResidentShape resident_shape(const SampleArgs& a, const DeviceInfo& info) {
  using cuda_kernels::kResidentWarps;
  const int L = a.num_layers;
  if (L < 2 || L > cuda_kernels::kResidentMaxLayers || a.dim > cuda_kernels::kResidentMaxDim) return {};
  const int H = a.layers[0].out;
  for (int l = 1; l + 1 < L; ++l) {
    if (a.layers[l].out != H) return {};
  }
  if (H > cuda_kernels::kResidentMaxHidden) return {};
  for (int l = 1; l < L; ++l) {
    if (reinterpret_cast<uintptr_t>(a.layers[l].weight) % 16 != 0) return {};
  }
  auto shape_of = [&](int opw) {
    const int cs = H / (kResidentWarps * opw);
    if (H % (kResidentWarps * opw) != 0 || cs > kMaxClusterSize || info.max_clusters[cs] == 0) return ResidentShape{};
    for (int rows : {1, 2, 4, 8}) {
      if (cuda_kernels::resident_fits(opw, rows, L) &&
          (static_cast<int64_t>(a.batch) + rows - 1) / rows <= info.max_clusters[cs])
        return ResidentShape{opw, rows, cs};
    }
    return ResidentShape{};
  };
  auto better = [&](const ResidentShape& p, const ResidentShape& q) {  // p before q
    if (q.opw == 0 || p.opw == 0) return p.opw != 0;
    if ((p.cs > 8) != (q.cs > 8)) return p.cs <= 8;
    if (p.rows * p.opw != q.rows * q.opw) return p.rows * p.opw < q.rows * q.opw;
    return a.num_steps >= kResidentManySteps ? p.rows < q.rows : p.opw < q.opw;
  };
  const int forced_cs = forced_cluster_size(info);
  ResidentShape best;
  for (int opw : {2, 4, 16}) {
    const ResidentShape shape = shape_of(opw);
    if (forced_cs != 0 && shape.cs == forced_cs) return shape;
    if (better(shape, best)) best = shape;
  }
  return best;
}

// Whether this call runs the resident kernel (shape *shape): wherever it can
// (small batches; it is exact), at any batch where DDPM_OPS_CUDA_KERNEL=
// resident forces it, never where it forces another kernel.
bool use_resident(const SampleArgs& a, const DeviceInfo& info, ResidentShape* shape) {
  *shape = resident_shape(a, info);
  const char* forced = std::getenv("DDPM_OPS_CUDA_KERNEL");
  return shape->opw != 0 && (forced == nullptr || std::strcmp(forced, "resident") == 0);
}

using ResidentKernel = void (*)(SampleArgs);

// The instantiation for this shape; only those that fit the registers exist
// (resident_shape offers no other).
template <int kOpw, int kRows, int kLayers>
ResidentKernel resident_kernel_if_it_fits() {
  if constexpr (cuda_kernels::resident_fits(kOpw, kRows, kLayers)) {
    return cuda_kernels::resident_sample_kernel<kOpw, kRows, kLayers>;
  } else {
    return nullptr;
  }
}

template <int kOpw, int kRows>
ResidentKernel resident_kernel_of_depth(int num_layers) {
  switch (num_layers) {
    case 2:
      return resident_kernel_if_it_fits<kOpw, kRows, 2>();
    case 3:
      return resident_kernel_if_it_fits<kOpw, kRows, 3>();
    default:
      return resident_kernel_if_it_fits<kOpw, kRows, 4>();
  }
}

template <int kOpw>
ResidentKernel resident_kernel_of_rows(int rows, int num_layers) {
  switch (rows) {
    case 1:
      return resident_kernel_of_depth<kOpw, 1>(num_layers);
    case 2:
      return resident_kernel_of_depth<kOpw, 2>(num_layers);
    case 4:
      return resident_kernel_of_depth<kOpw, 4>(num_layers);
    default:
      return resident_kernel_of_depth<kOpw, 8>(num_layers);
  }
}

void launch_resident(const SampleArgs& a, const ResidentShape& shape, const DeviceInfo& info, int device,
                     cudaStream_t stream) {
  const ResidentKernel kernel = shape.opw == 2   ? resident_kernel_of_rows<2>(shape.rows, a.num_layers)
                                : shape.opw == 4 ? resident_kernel_of_rows<4>(shape.rows, a.num_layers)
                                                 : resident_kernel_of_rows<16>(shape.rows, a.num_layers);
  TORCH_CHECK(kernel != nullptr, "ddpm::fused_sample: no resident kernel for ", shape.opw, " outputs per warp, ",
              shape.rows, " rows and ", a.num_layers, " layers (internal error)");
  const int64_t clusters = (static_cast<int64_t>(a.batch) + shape.rows - 1) / shape.rows;
  if (log_plans()) {
    std::fprintf(stderr,
                 "ddpm_ops resident kernel: batch %d, cluster size %d (%d co-resident), %d rows x %lld clusters, "
                 "%d outputs per warp\n",
                 a.batch, shape.cs, info.max_clusters[shape.cs], shape.rows, static_cast<long long>(clusters),
                 shape.opw);
  }
  prepare_kernel(kernel, device, info.max_smem, true);
  // All of the shared memory: one CTA per multiprocessor (resident_kernel.cuh).
  const ClusterLaunch launch(clusters, shape.cs, cuda_kernels::kResidentThreads, info.max_smem, stream);
  C10_CUDA_CHECK(cudaLaunchKernelEx(&launch.config, kernel, a));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

at::Tensor fused_sample_cuda(const at::Tensor& x, const at::Tensor& t_start,
                             at::TensorList weights, at::TensorList biases,
                             const at::Tensor& sqrt_recip_alphas,
                             const at::Tensor& coef_eps, int64_t num_steps,
                             int64_t total_timesteps, bool validate,
                             c10::string_view precision) {
  check_fused_sample_args(x, t_start, weights, biases, sqrt_recip_alphas, coef_eps, num_steps,
                          total_timesteps, precision);
  const Precision mode = parse_precision(precision);
  c10::cuda::CUDAGuard guard(x.device());
  const int64_t table_length = sqrt_recip_alphas.size(0);
  if (validate) {
    check_timesteps_in_range(t_start, num_steps, table_length);
  }
  const int64_t batch = x.size(0);
  if (num_steps == 0 || batch == 0) {
    return x.clone(at::MemoryFormat::Contiguous);
  }
  const int num_layers = static_cast<int>(weights.size());
  TORCH_CHECK(num_layers <= kMaxLayers, "ddpm::fused_sample: weights holds ", num_layers,
              " layers; the CUDA kernel supports at most ", kMaxLayers);
  TORCH_CHECK(batch <= INT32_MAX && table_length <= INT32_MAX && num_steps <= INT32_MAX,
              "ddpm::fused_sample: batch, num_steps and the table length must fit in int32 on CUDA");

  // Contiguous views (copies only for non-contiguous inputs), kept alive here.
  const at::Tensor x_c = x.contiguous();
  const at::Tensor t_c = t_start.contiguous();
  const at::Tensor c1_c = sqrt_recip_alphas.contiguous();
  const at::Tensor c2_c = coef_eps.contiguous();
  std::vector<at::Tensor> keep;
  keep.reserve(2 * num_layers);
  SampleArgs a = {};
  for (int l = 0; l < num_layers; ++l) {
    keep.push_back(weights[l].contiguous());
    keep.push_back(biases[l].contiguous());
    a.layers[l].weight = keep[2 * l].data_ptr<float>();
    a.layers[l].bias = keep[2 * l + 1].data_ptr<float>();
    a.layers[l].out = static_cast<int>(weights[l].size(0));
    a.layers[l].in = static_cast<int>(weights[l].size(1));
  }
  at::Tensor out = at::empty({batch, x.size(1)}, x.options());
  a.num_layers = num_layers;
  a.x = x_c.data_ptr<float>();
  a.t_start = t_c.data_ptr();
  a.t_is_int64 = t_c.scalar_type() == at::kLong;
  a.sqrt_recip_alphas = c1_c.data_ptr<float>();
  a.coef_eps = c2_c.data_ptr<float>();
  a.table_length = static_cast<int>(table_length);
  a.out = out.data_ptr<float>();
  a.batch = static_cast<int>(batch);
  a.dim = static_cast<int>(x.size(1));
  a.num_steps = static_cast<int>(num_steps);
  a.total_timesteps = static_cast<float>(total_timesteps);

  const int device = x.get_device();
  const DeviceInfo& info = device_info(device);
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device).stream();
  int wgmma_h = 0;
  if (use_wgmma(a, mode, info, &wgmma_h)) {
    switch (wgmma_h) {
      case 64:
        launch_wgmma<64>(a, info, device, stream);
        break;
      case 128:
        launch_wgmma<128>(a, info, device, stream);
        break;
      case 192:
        launch_wgmma<192>(a, info, device, stream);
        break;
      default:
        launch_wgmma<256>(a, info, device, stream);
    }
    return out;
  }
  ResidentShape resident;
  if (use_resident(a, info, &resident)) {
    launch_resident(a, resident, info, device, stream);
    return out;
  }
  NarrowShape narrow;
  if (use_narrow(a, info, &narrow)) {
    launch_narrow_shape(a, narrow, info, device, stream);
    return out;
  }
  SplitShape split;
  if (use_split(a, info, &split)) {
    if (split.cs == 1) {
      if (split.own == 64) {
        launch_split<64, 1>(a, info, device, stream);
      } else {
        launch_split<128, 1>(a, info, device, stream);
      }
    } else if (split.cs == 2) {
      if (split.own == 64) {
        launch_split<64, 2>(a, info, device, stream);
      } else {
        launch_split<128, 2>(a, info, device, stream);
      }
    } else {
      launch_split<64, 4>(a, info, device, stream);
    }
    return out;
  }
  const TiledChoice tiled = choose_tiled(a, info, cluster_weights_on_chip(a, info));
  const int cs = tiled.cs;
  switch (tiled.mt) {
    case 1:
      launch_tiled<1>(a, cs, mode, info, device, stream);
      break;
    case 2:
      launch_tiled<2>(a, cs, mode, info, device, stream);
      break;
    case 4:
      launch_tiled<4>(a, cs, mode, info, device, stream);
      break;
    default:
      launch_cluster(a, info, device, stream);
  }
  return out;
}

TORCH_LIBRARY_IMPL(ddpm, CUDA, m) { m.impl("fused_sample", &fused_sample_cuda); }

}  // namespace ddpm_ops
