// fp32_rule's instantiations (one per rows-per-block) and launch.
#include "../launch.h"
#include "fp32_rule.cuh"

namespace ddpm_ops {

using cuda_kernels::EngineArgs;
using cuda_kernels::fp32_rule_kernel;

void launch_fp32_rule(const plan::Plan& plan, const EngineArgs& a, const LaunchContext& ctx) {
  static_assert(cuda_kernels::kRuleMaxRows == 16, "an instantiation per power of two up to kRuleMaxRows");
  void (*kernel)(EngineArgs) = plan.rows == 1   ? fp32_rule_kernel<1>
                               : plan.rows == 2 ? fp32_rule_kernel<2>
                               : plan.rows == 4 ? fp32_rule_kernel<4>
                               : plan.rows == 8 ? fp32_rule_kernel<8>
                                                : fp32_rule_kernel<16>;
  launch_kernel(kernel, plan, ctx, a);
}

}  // namespace ddpm_ops
