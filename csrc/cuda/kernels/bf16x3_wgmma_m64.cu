// bf16x3_wgmma_m64's instantiations (columns per CTA, cluster size, exchange
// buffers) and launch.
#include "../launch.h"
#include "bf16x3_wgmma_m64.cuh"

namespace ddpm_ops {
namespace {

template <int kOwn, int kCs>
void launch_shape(const plan::Plan& plan, const SampleArgs& a, const LaunchContext& ctx) {
  auto kernel = cuda_kernels::bf16x3_wgmma_m64_kernel<kOwn, kCs, 1>;
  if constexpr (kCs > 1) {
    if (plan.buffers == 2) kernel = cuda_kernels::bf16x3_wgmma_m64_kernel<kOwn, kCs, 2>;
  }
  launch_kernel(kernel, plan, ctx, a);
}

}  // namespace

void launch_bf16x3_wgmma_m64(const plan::Plan& plan, const SampleArgs& a, const LaunchContext& ctx) {
  with_bf16x3_shape(plan, [&](auto own, auto cs) { launch_shape<decltype(own)::value, decltype(cs)::value>(plan, a, ctx); });
}

}  // namespace ddpm_ops
