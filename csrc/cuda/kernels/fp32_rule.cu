// fp32_rule's instantiations (one per rows-per-block, with and without a
// network program) and launch.
#include "../launch.h"
#include "fp32_rule.cuh"

#include <ATen/ATen.h>

#include <algorithm>
#include <type_traits>

namespace ddpm_ops {

using cuda_kernels::EngineArgs;
using cuda_kernels::fp32_rule_kernel;
using cuda_kernels::ProgramArgs;
using cuda_kernels::RuleGridArgs;

void launch_fp32_rule(const plan::Plan& plan, const EngineArgs& a, const ProgramArgs& program,
                      const LaunchContext& ctx) {
  static_assert(cuda_kernels::kRuleMaxRows == 16, "an instantiation per power of two up to kRuleMaxRows");
  const auto pick = [&](auto program_tag) -> void (*)(EngineArgs, ProgramArgs, RuleGridArgs) {
    constexpr bool kProgram = decltype(program_tag)::value;
    return plan.rows == 1   ? fp32_rule_kernel<1, kProgram>
           : plan.rows == 2 ? fp32_rule_kernel<2, kProgram>
           : plan.rows == 4 ? fp32_rule_kernel<4, kProgram>
           : plan.rows == 8 ? fp32_rule_kernel<8, kProgram>
                            : fp32_rule_kernel<16, kProgram>;
  };
  // A group's exchange buffers (RuleGridArgs), from the caching allocator:
  // freed once the launch is queued, reused only by work queued after it.
  RuleGridArgs grid = {std::max(plan.split, 1), nullptr, plan.split_ld};
  at::Tensor exchange;
  if (plan.split > 1) {
    exchange = at::empty({plan.tiles * 2 * plan.rows * plan.split_ld},
                         at::TensorOptions().dtype(at::kFloat).device(at::kCUDA, ctx.device));
    grid.exchange = exchange.data_ptr<float>();
  }
  launch_kernel(program.num_ops > 0 ? pick(std::true_type{}) : pick(std::false_type{}), plan, ctx, a, program, grid);
}

}  // namespace ddpm_ops
