// The rows of fused_sample.rule's step_tables, for host code and kernels.
#pragma once

#include <cstdint>

namespace ddpm_ops {

// step_tables' rows, in this order: x0 = A x - B e; x = C x0 + D x + E e + S z
// (+ P x0_prev, the previous step's clipped x0, where a seventh row is given:
// multistep solvers).
constexpr int64_t kStepTables = 6;
constexpr int64_t kMaxStepTables = 7;
enum StepTable : int64_t { kA, kB, kC, kD, kE, kS, kP };

}  // namespace ddpm_ops
