// fp32_rule's instantiations (one per rows-per-block, with and without a
// network program) and launch.
#include "../launch.h"
#include "fp32_rule.cuh"

#include <type_traits>

namespace ddpm_ops {

using cuda_kernels::EngineArgs;
using cuda_kernels::fp32_rule_kernel;
using cuda_kernels::ProgramArgs;

void launch_fp32_rule(const plan::Plan& plan, const EngineArgs& a, const ProgramArgs& program,
                      const LaunchContext& ctx) {
  static_assert(cuda_kernels::kRuleMaxRows == 16, "an instantiation per power of two up to kRuleMaxRows");
  const auto pick = [&](auto program_tag) -> void (*)(EngineArgs, ProgramArgs) {
    constexpr bool kProgram = decltype(program_tag)::value;
    return plan.rows == 1   ? fp32_rule_kernel<1, kProgram>
           : plan.rows == 2 ? fp32_rule_kernel<2, kProgram>
           : plan.rows == 4 ? fp32_rule_kernel<4, kProgram>
           : plan.rows == 8 ? fp32_rule_kernel<8, kProgram>
                            : fp32_rule_kernel<16, kProgram>;
  };
  launch_kernel(program.num_ops > 0 ? pick(std::true_type{}) : pick(std::false_type{}), plan, ctx, a, program);
}

}  // namespace ddpm_ops
