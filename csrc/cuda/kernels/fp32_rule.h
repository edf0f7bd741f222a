// The fp32_rule kernel of ddpm::fused_sample.rule: what it takes and how many
// rows a thread block runs. Plain C++ (host code includes it).
#pragma once

#include <cstddef>
#include <cstdint>

#include "../../activation.h"
#include "../../step_tables.h"
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

struct RuleArgs {
  LayerArgs layers[kMaxLayers];
  Activation activations[kMaxLayers];  // after layer l < num_layers - 1
  int num_layers;
  int width;   // the widest layer's output rounded up to 4: the activations' row stride
  int dim_ld;  // dim rounded up to 4: the samples' row stride
  const float* x;       // (batch, dim) contiguous
  const void* t_start;  // (batch,) int32 or int64
  bool t_is_int64;
  const float* tables;  // (6, table_length): the rows A, B, C, D, E, S
  int table_length;
  const float* time_rows;     // (table_length, out_0) or null: time_bias plus the time network
  const float* cond_rows;     // (batch, out_0) or null: cond_bias plus the condition network
  const float* noise;         // (num_steps, batch, dim) or null
  const int64_t* noise_seed;  // in device memory: one element, or with seed_per_row (batch,); or null
  bool seed_per_row;
  bool clip, post_clip;
  float clip_lo, clip_hi, post_lo, post_hi;
  float* out;  // (batch, dim), or with `chain` (num_steps + 1, batch, dim)
  bool chain;
  int batch;
  int dim;
  int num_steps;
};

// A block's shared memory, all of it dynamic (prepare_kernel lets a kernel
// ask for the device's whole opt-in size, which leaves no room for static
// arrays): per row its first step index, its step index now, whether it is
// valid and its six coefficients, rounded up to float4s; then the samples
// (rows, dim_ld) and two activation buffers (rows, width).
DDPM_HD inline int rule_row_header_floats(int rows) { return round_up4(static_cast<int>(3 + kStepTables) * rows); }
DDPM_HD inline size_t rule_smem_bytes(int rows, int dim_ld, int width) {
  return sizeof(float) * (rule_row_header_floats(rows) +
                          static_cast<size_t>(rows) * (dim_ld + 2 * static_cast<size_t>(width)));
}

// Rows per thread block: doubled from 1 while the blocks would outnumber the
// SMs' share of the batch (a small batch spreads over the SMs, a large one
// reuses each weight it loads for more rows), at most kRuleMaxRows, and
// halved until the samples and two activation buffers fit in shared memory.
// 0: not even one row fits.
inline int rule_rows_per_block(int64_t batch, int sm_count, int dim_ld, int width, int max_smem) {
  int rows = 1;
  while (rows < kRuleMaxRows && static_cast<int64_t>(rows) * sm_count < batch) rows *= 2;
  while (rows > 1 && rule_smem_bytes(rows, dim_ld, width) > static_cast<size_t>(max_smem)) rows /= 2;
  return rule_smem_bytes(rows, dim_ld, width) <= static_cast<size_t>(max_smem) ? rows : 0;
}

}  // namespace cuda_kernels
}  // namespace ddpm_ops
