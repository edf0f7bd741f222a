// What every kernel of ddpm::fused_sample takes (the net, the tables and the
// batch as raw pointers), filled on the host (fused_sample_cuda.cu).
#pragma once

#include <cstdint>

#include "../../common/activation.h"
#include "../../common/sizes.h"
#include "../../common/step_tables.h"

namespace ddpm_ops {
namespace cuda_kernels {

struct LayerArgs {
  const float* weight;  // (out, in) with row stride ld, global memory
  const float* bias;    // (out,)
  int in;
  int out;
  int ld;  // the weight's row stride: `in`, or more where the weight is a view of wider rows
           // (as fused_sample.rule's layer 0 over a Linear's x columns, or the time-column
           // overload's layer 0, whose last column is the time column)
};

// The time-column overload's arguments, for the kernels that run it alone
// (fp32_smem, bf16_wgmma, bf16x3_wgmma_m64, bf16x3_wgmma_swapab). Layer 0's
// `in` is dim + 1: these kernels read [x, t / T] as its input.
struct SampleArgs {
  LayerArgs layers[kMaxLayers];
  int num_layers;
  const float* x;          // (batch, dim) contiguous
  const void* t_start;     // (batch,) int32 or int64
  bool t_is_int64;
  const float* sqrt_recip_alphas;
  const float* coef_eps;
  int table_length;
  float* out;              // (batch, dim) contiguous
  int batch;
  int dim;
  int num_steps;
  float total_timesteps;
};

// A bias network the kernel runs itself (fused_sample.rule's time_* or
// cond_* arguments): input rows through Linear layers, activations[l] after
// each but the last, which has no bias and outputs layer 0's width.
constexpr int kMaxBiasNetLayers = 4;
struct BiasNetArgs {
  const float* input;  // (rows, layers[0].in) contiguous, or null: no network
  LayerArgs layers[kMaxBiasNetLayers];
  Activation activations[kMaxBiasNetLayers];
  int num_layers;
  int widest_hidden;  // the widest output but the last's (0 for one layer)
};

// The prologue's arguments (common/prologue.cuh): what is added to layer 0's
// output besides its bias, per (row, step index t, column c), s being t
// clamped into the tables:
//   time_rows[s][c] + time_column[c * time_column_ld] * t / time_divisor + cond_rows[row][c]
//   + time_net(time_net.input[s])[c] + cond_net(cond_net.input[row])[c]
// each term absent where its pointer is null. The time-column overload is
// the time_column term (layer 0's last weight column, t / T). The kernel
// evaluates the networks into shared memory: the condition rows of its rows
// once, the time rows of its rows for `window` steps at a time. A network
// the plan leaves no room for, or deeper than kMaxBiasNetLayers, is
// evaluated before the launch and added to time_rows or cond_rows.
struct BiasRowArgs {
  const float* time_rows;    // (table_length, out_0): time_bias
  const float* time_column;  // out_0 weights, stride time_column_ld
  int time_column_ld;
  float time_divisor;
  const float* cond_rows;    // (batch, out_0): cond_bias
  BiasNetArgs time_net;
  BiasNetArgs cond_net;
  int window;  // steps of time rows evaluated at once (plan::Plan::bias_window)
};

// A CUDA generator's Philox state for one call (at::PhiloxCudaState's
// fields): under CUDA-graph capture the seed and the offset are read from
// device memory, so that each replay draws anew, as torch's own random ops do.
struct GeneratorArgs {
  bool used;
  bool captured;
  uint64_t seed, offset;      // not captured
  const int64_t* seed_ptr;    // captured
  const int64_t* offset_ptr;  // captured, plus offset_intragraph
  uint64_t offset_intragraph;
};

// The epilogue's arguments (common/epilogue.cuh): one step of the rule
//   x0 = A x - B e, clipped;  x = C x0 + D x + E e + S z + P x0_prev, clipped
// with the coefficients of the row's step index s (z clamped to
// +-noise_clip where that is set). A null table is the identity's: A = 1,
// the others 0 (the time-column overload gives B and C).
struct StepArgs {
  const float* tables[kStepTablesWithPrevious];  // each (table_length,), or null
  bool clip, post_clip;
  float clip_lo, clip_hi, post_lo, post_hi;  // the scalar bounds
  const float* clip_bounds;       // (2, dim): per-column bounds (lower row, upper row), or null
  const float* post_clip_bounds;  // the same for the post clip
  const float* noise;             // (num_steps, batch, dim), or null
  const int64_t* noise_seed;      // device memory: one seed, or one per row (seed_per_row); or null
  bool seed_per_row;
  GeneratorArgs generator;  // where noise_seed is null: the call's seed from a generator
  float noise_clip;         // > 0: z (given or drawn) clamped to [-noise_clip, noise_clip]; 0: no clamp
  float* out;  // (batch, dim), or with chain (num_steps + 1, batch, dim)
  bool chain;
};

// One call of the general step, as every engine kernel (fp32_resident,
// tf32x3_tiled, fp32_rule) takes it: both overloads arrive here (the
// time-column overload through the adapter in fused_sample_cuda.cu).
struct EngineArgs {
  LayerArgs layers[kMaxLayers];
  Activation activations[kMaxLayers];  // after layer l < num_layers - 1
  int num_layers;
  const float* x;       // (batch, dim) contiguous
  const void* t_start;  // (batch,) int32 or int64
  bool t_is_int64;
  int table_length;
  int batch;
  int dim;
  int num_steps;
  BiasRowArgs bias_rows;
  StepArgs step;
};

}  // namespace cuda_kernels
}  // namespace ddpm_ops
