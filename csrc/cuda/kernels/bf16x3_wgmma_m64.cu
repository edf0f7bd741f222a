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
  if (plan.cluster_size == 1) {
    return plan.own == 64 ? launch_shape<64, 1>(plan, a, ctx) : launch_shape<128, 1>(plan, a, ctx);
  }
  if (plan.cluster_size == 2) {
    return plan.own == 64 ? launch_shape<64, 2>(plan, a, ctx) : launch_shape<128, 2>(plan, a, ctx);
  }
  launch_shape<64, 4>(plan, a, ctx);
}

}  // namespace ddpm_ops
