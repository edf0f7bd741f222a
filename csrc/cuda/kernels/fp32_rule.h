// The fp32_rule kernel of the engine: its block shape and how many rows a
// thread block runs. Plain C++ (the plan includes it).
#pragma once

#include <cstddef>
#include <cstdint>

#include "../common/args.h"

namespace ddpm_ops {
namespace cuda_kernels {

// Rows per block: 1, 2, 4, 8 or 16 (an instantiation each).
constexpr int kRuleMaxRows = 16;

// A warp computes `rule_columns(rows)` output columns of a layer for all the
// block's rows at once (rows * columns sums, reduced across its lanes), so
// that many weight rows are in flight; the columns shrink as the rows grow to
// keep the sums and the weights' float4s in registers at the block size
// `rule_threads(rows)`: 32 warps for one or two rows, whose layers then have
// the most columns in flight per block, 16 for more.
DDPM_HD constexpr int rule_threads(int rows) { return rows <= 2 ? 1024 : 512; }
DDPM_HD constexpr int rule_columns(int rows) { return rows == 1 ? 8 : (rows <= 8 ? 4 : 2); }

// A block's shared memory, all of it dynamic (prepare_kernel lets a kernel
// ask for the device's whole opt-in size, which leaves no room for static
// arrays): per row its first step index, its step index now, whether it is
// valid and its coefficients, rounded up to float4s; then the samples and the
// previous x0 (rows, dim_ld each), two activation buffers (rows, width) and
// the bias networks' rows (bias_net_floats).
DDPM_HD inline int rule_row_header_floats(int rows) {
  return round_up4(static_cast<int>(3 + kStepTablesWithPrevious) * rows);
}
DDPM_HD inline size_t rule_smem_bytes(int rows, int dim_ld, int width, int bias_floats = 0) {
  return sizeof(float) * (rule_row_header_floats(rows) + static_cast<size_t>(bias_floats) +
                          static_cast<size_t>(rows) * (2 * static_cast<size_t>(dim_ld) + 2 * static_cast<size_t>(width)));
}

}  // namespace cuda_kernels
}  // namespace ddpm_ops
