// The launch path every kernel takes (prepare, log, configure, launch,
// check), and each kernel's launcher (kernels/<name>.cu), which picks its
// instantiation for a plan.
#pragma once

#include "../plan/plan.h"
#include "common/args.h"
#include "kernels/fp32_rule.h"

#include <c10/cuda/CUDAException.h>
#include <cuda_runtime.h>

#include <type_traits>

namespace ddpm_ops {

using cuda_kernels::SampleArgs;

struct LaunchContext {
  int device;
  int max_smem;
  cudaStream_t stream;
  bool log;  // DDPM_OPS_CUDA_LOG
  const plan::Problem* problem;
};

// Raises a kernel's dynamic shared-memory limit (and, for cluster kernels,
// allows the non-portable size 16) once per device.
void prepare_kernel(const void* kernel, int device, int max_smem, bool cluster);

// The configuration of a launch of `grid` clusters of `cluster_size` CTAs, or
// of `grid` CTAs where cluster_size is 0 (one place for the attribute
// plumbing; not copyable: it points into itself).
struct LaunchConfig {
  cudaLaunchConfig_t config = {};
  cudaLaunchAttribute attribute = {};
  LaunchConfig(int64_t grid, int cluster_size, unsigned threads, size_t smem, cudaStream_t stream);
  LaunchConfig(const LaunchConfig&) = delete;
  LaunchConfig& operator=(const LaunchConfig&) = delete;
};

void log_launch(const plan::Plan& plan, const LaunchContext& ctx);

template <typename... Params, typename... Args>
void launch_kernel(void (*kernel)(Params...), const plan::Plan& plan, const LaunchContext& ctx,
                   const Args&... args) {
  prepare_kernel(reinterpret_cast<const void*>(kernel), ctx.device, ctx.max_smem, plan.cluster_size > 0);
  if (ctx.log) log_launch(plan, ctx);
  const LaunchConfig launch(plan.grid, plan.cluster_size, static_cast<unsigned>(plan.threads),
                            static_cast<size_t>(plan.smem), ctx.stream);
  C10_CUDA_CHECK(cudaLaunchKernelEx(&launch.config, kernel, args...));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// Calls launch(own, cs) with the bf16x3 kernels' instantiated (columns per
// CTA, cluster size) pair of the plan as std::integral_constant values
// (plan::detail's kBf16x3Shapes).
template <typename Launch>
void with_bf16x3_shape(const plan::Plan& plan, Launch&& launch) {
  using I64 = std::integral_constant<int, 64>;
  using I128 = std::integral_constant<int, 128>;
  if (plan.cluster_size == 1) {
    return plan.own == 64 ? launch(I64{}, std::integral_constant<int, 1>{}) : launch(I128{}, std::integral_constant<int, 1>{});
  }
  if (plan.cluster_size == 2) {
    return plan.own == 64 ? launch(I64{}, std::integral_constant<int, 2>{}) : launch(I128{}, std::integral_constant<int, 2>{});
  }
  launch(I64{}, std::integral_constant<int, 4>{});
}

// The engine's kernels: the general step of both overloads.
void launch_fp32_resident(const plan::Plan& plan, const cuda_kernels::EngineArgs& a, const LaunchContext& ctx);
// fp32_rule also runs network programs (`program`; num_ops 0: none).
void launch_fp32_rule(const plan::Plan& plan, const cuda_kernels::EngineArgs& a,
                      const cuda_kernels::ProgramArgs& program, const LaunchContext& ctx);
void launch_tf32x3_tiled(const plan::Plan& plan, const cuda_kernels::EngineArgs& a, const LaunchContext& ctx);
// The kernels of the time-column overload alone.
void launch_fp32_smem(const plan::Plan& plan, const SampleArgs& a, const LaunchContext& ctx);
void launch_bf16_wgmma(const plan::Plan& plan, const SampleArgs& a, const LaunchContext& ctx);
void launch_bf16x3_wgmma_m64(const plan::Plan& plan, const SampleArgs& a, const LaunchContext& ctx);
void launch_bf16x3_wgmma_swapab(const plan::Plan& plan, const SampleArgs& a, const LaunchContext& ctx);

// Co-resident clusters of each size 1 to plan::kMaxClusterSize (one CTA per
// SM, all of the shared memory), 0 where a size does not launch: every
// cluster kernel asks for the same, so fp32_smem's answer serves all.
void co_resident_clusters(int device, int max_smem, int* max_clusters);
// Whether the driver has the tensor-map encoder tf32x3_tiled's TMA copies need.
bool has_tensor_map_encoder();

}  // namespace ddpm_ops
