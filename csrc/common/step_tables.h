// The rows of fused_sample.rule's step_tables, for host code and kernels.
#pragma once

#include <cstdint>

namespace ddpm_ops {

// step_tables' rows, in this order: x0 = A x - B e (then the clamp);
// x = C x0 + D x + E e + S z + P x0_prev, x0_prev the previous step's clamped
// x0 (zero at a call's first step: a multistep solver's term, DPM-Solver++ 2M).
// The P row is optional: tables of kStepTables rows have no x0_prev term.
// Tables of kStepTablesWithEpsReadback rows also hold Q and R: the E term then
// multiplies the eps read back from the clamped x0, Q x - R x0 (clamped to
// eps_clip where that is given: DPPO's DDIM), instead of the network's e.
constexpr int64_t kStepTables = 6;
constexpr int64_t kStepTablesWithPrevious = 7;
constexpr int64_t kStepTablesWithEpsReadback = 9;
enum StepTable : int64_t { kA, kB, kC, kD, kE, kS, kP, kQ, kR };

}  // namespace ddpm_ops
