// fp32_rule's instantiations (one per rows-per-block, with and without a
// network program, alone or in a cluster) and launch.
#include "../launch.h"
#include "fp32_rule.cuh"

#include <type_traits>

namespace ddpm_ops {

using cuda_kernels::EngineArgs;
using cuda_kernels::fp32_rule_kernel;
using cuda_kernels::ProgramArgs;
using shapes::RuleWeights;

void launch_fp32_rule(const plan::Plan& plan, const EngineArgs& a, const ProgramArgs& program,
                      const LaunchContext& ctx) {
  static_assert(shapes::kRuleMaxRows == 16, "an instantiation per power of two up to kRuleMaxRows");
  const auto pick = [&](auto program_tag, auto cluster_tag) -> void (*)(EngineArgs, ProgramArgs, RuleWeights) {
    constexpr bool kProgram = decltype(program_tag)::value, kCluster = decltype(cluster_tag)::value;
    return plan.rows == 1   ? fp32_rule_kernel<1, kProgram, kCluster>
           : plan.rows == 2 ? fp32_rule_kernel<2, kProgram, kCluster>
           : plan.rows == 4 ? fp32_rule_kernel<4, kProgram, kCluster>
           : plan.rows == 8 ? fp32_rule_kernel<8, kProgram, kCluster>
                            : fp32_rule_kernel<16, kProgram, kCluster>;
  };
  const auto for_program = [&](auto cluster_tag) {
    return program.num_ops > 0 ? pick(std::true_type{}, cluster_tag) : pick(std::false_type{}, cluster_tag);
  };
  launch_kernel(plan.cluster_size > 0 ? for_program(std::true_type{}) : for_program(std::false_type{}), plan, ctx, a,
                program, plan.rule_weights);
}

}  // namespace ddpm_ops
