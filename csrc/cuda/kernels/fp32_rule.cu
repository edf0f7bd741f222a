// fp32_rule's instantiations (one per rows-per-block) and launch.
#include "../launch.h"
#include "fp32_rule.cuh"

namespace ddpm_ops {

using cuda_kernels::fp32_rule_kernel;
using cuda_kernels::RuleArgs;

void launch_fp32_rule(int rows, const RuleArgs& a, const LaunchContext& ctx) {
  void (*kernel)(RuleArgs) = rows == 1   ? fp32_rule_kernel<1>
                             : rows == 2 ? fp32_rule_kernel<2>
                             : rows == 4 ? fp32_rule_kernel<4>
                             : rows == 8 ? fp32_rule_kernel<8>
                                         : fp32_rule_kernel<16>;
  static_assert(cuda_kernels::kRuleMaxRows == 16, "an instantiation per power of two up to kRuleMaxRows");
  prepare_kernel(reinterpret_cast<const void*>(kernel), ctx.device, ctx.max_smem, false);
  const LaunchConfig launch((a.batch + rows - 1) / rows, 0, cuda_kernels::rule_threads(rows),
                            cuda_kernels::rule_smem_bytes(rows, a.dim_ld, a.width), ctx.stream);
  C10_CUDA_CHECK(cudaLaunchKernelEx(&launch.config, kernel, a));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace ddpm_ops
