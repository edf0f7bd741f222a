// bf16x3_wgmma_swapab's instantiations (columns per CTA, cluster size, tile
// rows) and launch.
#include "../launch.h"
#include "bf16x3_wgmma_swapab.cuh"

namespace ddpm_ops {
namespace {

template <int kOwn, int kCs>
void launch_shape(const plan::Plan& plan, const SampleArgs& a, const LaunchContext& ctx) {
  using cuda_kernels::bf16x3_wgmma_swapab_kernel;
  switch (plan.rows) {
    case 8:
      return launch_kernel(bf16x3_wgmma_swapab_kernel<kOwn, kCs, 8>, plan, ctx, a);
    case 16:
      return launch_kernel(bf16x3_wgmma_swapab_kernel<kOwn, kCs, 16>, plan, ctx, a);
    case 24:
      return launch_kernel(bf16x3_wgmma_swapab_kernel<kOwn, kCs, 24>, plan, ctx, a);
    default:
      return launch_kernel(bf16x3_wgmma_swapab_kernel<kOwn, kCs, 32>, plan, ctx, a);
  }
}

}  // namespace

void launch_bf16x3_wgmma_swapab(const plan::Plan& plan, const SampleArgs& a, const LaunchContext& ctx) {
  with_bf16x3_shape(plan, [&](auto own, auto cs) { launch_shape<decltype(own)::value, decltype(cs)::value>(plan, a, ctx); });
}

}  // namespace ddpm_ops
