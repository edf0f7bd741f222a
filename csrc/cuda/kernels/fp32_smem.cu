// fp32_smem's instantiations (one per warp-tile height) and launch.
#include "../launch.h"
#include "fp32_smem.cuh"

namespace ddpm_ops {

using cuda_kernels::fp32_smem_kernel;

void launch_fp32_smem(const plan::Plan& plan, const SampleArgs& a, const LaunchContext& ctx) {
  void (*kernel)(SampleArgs, shapes::SmemPlan) = plan.warp_rows == 1   ? fp32_smem_kernel<1>
                                                 : plan.warp_rows == 2 ? fp32_smem_kernel<2>
                                                                       : fp32_smem_kernel<4>;
  launch_kernel(kernel, plan, ctx, a, plan.smem_plan);
}

void co_resident_clusters(int device, int max_smem, int* max_clusters) {
  const void* kernel = reinterpret_cast<const void*>(fp32_smem_kernel<1>);
  prepare_kernel(kernel, device, max_smem, true);
  for (int size = 1; size <= plan::kMaxClusterSize; ++size) {
    const LaunchConfig launch(1, size, shapes::kSmemThreads, max_smem, nullptr);
    int clusters = 0;
    if (cudaOccupancyMaxActiveClusters(&clusters, kernel, &launch.config) != cudaSuccess) {
      (void)cudaGetLastError();  // an unsupported size is an answer, not an error
      clusters = 0;
    }
    max_clusters[size] = clusters;
  }
}

}  // namespace ddpm_ops
