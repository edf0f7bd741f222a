// The fp32_rule kernel's block shape, how many rows a thread block runs, and
// its shared memory.
#pragma once

#include "../../common/host_device.h"
#include "../../common/sizes.h"
#include "../../common/step_tables.h"

#include <cstddef>
#include <cstdint>

namespace ddpm_ops {
namespace shapes {

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

// The output columns each CTA of a cluster of `cluster` computes in a layer
// of n, for blocks of `rows` rows: whole groups of a warp's columns, the
// last CTA's share shorter (RuleCluster::columns).
DDPM_HD inline int rule_column_share(int n, int cluster, int rows) {
  const int group = rule_columns(rows);
  return ((n + cluster - 1) / cluster + group - 1) / group * group;
}
// The floats of a CTA's share of a layer's weights kept in shared memory:
// its rows of the layer's columns, each `in` floats rounded up to float4s.
DDPM_HD inline int64_t rule_weight_share_floats(int out, int in, int cluster, int rows) {
  return static_cast<int64_t>(rule_column_share(out, cluster, rows)) * round_up4(in);
}
// Where each CTA keeps its share of each layer's weights, as the plan chose:
// the offset in floats from the start of its shared memory (after
// rule_smem_bytes), copied there once per launch, or 0 where the layer
// streams from L2 at every step.
struct RuleWeights {
  int offset[kMaxLayers];
};

// A block's shared memory, all of it dynamic (prepare_kernel lets a kernel
// ask for the device's whole opt-in size, which leaves no room for static
// arrays): per row its first step index, its step index now, whether it is
// valid and its coefficients, rounded up to float4s; rule_layer's partial
// sums (rule_scratch_floats); then the samples and the
// previous x0 (rows, dim_ld each), two activation buffers (rows, width), a
// network program's `saved_buffers` more (its residual stack) and the bias
// networks' rows (bias_net_floats); then the weights kept on chip
// (RuleWeights).
DDPM_HD inline int rule_row_header_floats(int rows) {
  return round_up4(static_cast<int>(3 + kStepTablesWithPrevious) * rows);
}
// The partial sums of a layer whose columns' inner dimension is split over
// warps (rule_layer): every warp's sums.
DDPM_HD constexpr int rule_scratch_floats(int rows) { return rule_threads(rows) / 32 * rows * rule_columns(rows); }
DDPM_HD inline size_t rule_smem_bytes(int rows, int dim_ld, int width, int bias_floats = 0, int saved_buffers = 0) {
  return sizeof(float) * (rule_row_header_floats(rows) + rule_scratch_floats(rows) + static_cast<size_t>(bias_floats) +
                          static_cast<size_t>(rows) * (2 * static_cast<size_t>(dim_ld) +
                                                       (2 + static_cast<size_t>(saved_buffers)) * static_cast<size_t>(width)));
}

}  // namespace shapes
}  // namespace ddpm_ops
