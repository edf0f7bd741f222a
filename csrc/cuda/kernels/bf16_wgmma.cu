// bf16_wgmma's instantiations (padded hidden width 64 to 256) and launch.
#include "../launch.h"
#include "bf16_wgmma.cuh"

namespace ddpm_ops {

void launch_bf16_wgmma(const plan::Plan& plan, const SampleArgs& a, const LaunchContext& ctx) {
  using cuda_kernels::bf16_wgmma_kernel;
  switch (plan.hidden) {
    case 64:
      return launch_kernel(bf16_wgmma_kernel<64>, plan, ctx, a);
    case 128:
      return launch_kernel(bf16_wgmma_kernel<128>, plan, ctx, a);
    case 192:
      return launch_kernel(bf16_wgmma_kernel<192>, plan, ctx, a);
    default:
      return launch_kernel(bf16_wgmma_kernel<256>, plan, ctx, a);
  }
}

}  // namespace ddpm_ops
