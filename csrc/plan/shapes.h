// The candidates of choose_plan (plan.cpp): for each kernel, whether it can
// run the call and in which shape. Internal to csrc/plan.
#pragma once

#include "plan.h"

#include <algorithm>
#include <cstdint>

namespace ddpm_ops {
namespace plan {
namespace detail {

inline int round_up(int v, int m) { return (v + m - 1) / m * m; }
inline int64_t ceil_div(int64_t n, int64_t d) { return (n + d - 1) / d; }

// The widest hidden layer (0 without one).
inline int widest_hidden(const Problem& p) {
  int widest = 0;
  for (int l = 0; l + 1 < p.num_layers; ++l) widest = std::max(widest, p.layers[l].out);
  return widest;
}

// DDPM_OPS_CUDA_CLUSTER_SIZE where that size launches on this device, else 0.
inline int forced_cluster_size(const Device& d, const Overrides& o) {
  const int size = o.cluster_size;
  return size >= 1 && size <= kMaxClusterSize && d.max_clusters[size] > 0 ? size : 0;
}

// Each fills *plan with the kernel's shape for the call and returns true, or
// returns false where the kernel cannot run it (fp32_shapes.cpp,
// wgmma_shapes.cpp). The shape honours DDPM_OPS_CUDA_CLUSTER_SIZE and
// DDPM_OPS_CUDA_TILE_ROWS where a shape of that size exists.
bool fp32_resident_shape(const Problem& p, const Device& d, const Overrides& o, Plan* plan);
bool bf16_wgmma_shape(const Problem& p, const Device& d, Plan* plan);
bool bf16x3_wgmma_m64_shape(const Problem& p, const Device& d, const Overrides& o, Plan* plan);
bool bf16x3_wgmma_swapab_shape(const Problem& p, const Device& d, const Overrides& o, Plan* plan);

// The last resort, which always has an answer: tf32x3_tiled where its rule
// or DDPM_OPS_CUDA_KERNEL asks for it and a tile fits, else fp32_smem (whose
// plan carries an error where not even one row fits), or an error plan where
// no kernel runs on the device.
Plan tiled_or_smem(const Problem& p, const Device& d, const Overrides& o);

}  // namespace detail
}  // namespace plan
}  // namespace ddpm_ops
