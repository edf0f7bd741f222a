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

// The most steps of time rows an engine kernel evaluates at once: each
// evaluation is a few block barriers, so a long call takes a few.
constexpr int kMaxBiasWindow = 32;

// The bias window of an engine kernel's plan (Plan::bias_window) for a block
// whose shared memory fits(window) says fits: 1 without a time network (the
// condition rows alone), else the largest up to the call's steps and
// kMaxBiasWindow; 0 where none fits (the host evaluates the networks) or the
// call has no network.
template <typename Fits>
int bias_window(const Problem& p, Fits fits) {
  if (!p.time_net && !p.cond_net) return 0;
  int window = p.time_net ? std::max(1, std::min(p.num_steps, kMaxBiasWindow)) : 1;
  while (window > 1 && !fits(window)) window = (window + 1) / 2;
  return fits(window) ? window : 0;
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
// fp32_rule: plain blocks on any GPU, wherever a block's rows fit shared memory.
bool fp32_rule_shape(const Problem& p, const Device& d, const Overrides& o, Plan* plan);

// The time-column overload's last resort on Hopper, which always has an
// answer: tf32x3_tiled where its rule or DDPM_OPS_CUDA_KERNEL asks for it and
// a tile fits, else fp32_smem (whose plan carries an error where not even one
// row fits). Only for a device where d.hopper() and clusters of 1 launch: its
// clusters of 1 then launch, and no count of co-resident clusters it divides
// by is 0.
Plan tiled_or_smem(const Problem& p, const Device& d, const Overrides& o);
// tf32x3_tiled as an engine kernel, on any device: the general step where
// fp32_resident does not fit, and both overloads below 9.0 (tiles of one
// CTA, chunks by cp.async: the portable path); from kTiledMinBatch, or at
// any batch where any_batch (fp32_rule does not fit) or
// DDPM_OPS_CUDA_KERNEL=tiled16|32|64.
bool tf32x3_tiled_shape(const Problem& p, const Device& d, const Overrides& o, bool any_batch, Plan* plan);

}  // namespace detail
}  // namespace plan
}  // namespace ddpm_ops
